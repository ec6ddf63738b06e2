"""The megatron-core trainer engine on CPU (gloo ranks as spawned processes, 1 thread each).

- core's trainer contract (``check_trainer_engine``) at TP=2 x DP=2 (4 ranks) and at PP=2:
  log-probs equal transformers' on the same weights, export round-trips into
  ``AutoModelForCausalLM``, checkpoints restore the log-probs, optimizer and scheduler;
- TP=1, TP=2 x DP=2, PP=2 and laminar-fsdp agree on the same batch (log-probs before and
  after a step, loss, grad norm);
- a TP=2 x DP=2 checkpoint loads at TP=1 (one rank) with the same log-probs;
- the vocabulary-parallel log-probs equal the gathered full-vocabulary ones (and their
  gradients), without the full vocabulary on any rank;
- activation recompute really drops saved activations (full and selective);
- a Llama (untied head, no biases) and a Qwen3 (q/k norms) pass the contract too;
- a tp*pp*dp that does not match the world size is a one-line error.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import torch.multiprocessing as mp

from laminar_core import free_port
from laminar_core.models import build_tiny_model
from laminar_core.testing import check_trainer_engine, contract_batch
from laminar_core.training import plan_micro_batches, response_mask, responses

os.environ.setdefault("OMP_NUM_THREADS", "1")
TOL = 1e-4  # float32 log-probs / losses
BASE = ["trainer.megatron.lr=1e-3", "trainer.megatron.micro_batch_tokens=40"]


def _gpus_for(ranks: int) -> None:
    """megatron-core runs NCCL wherever CUDA is (gloo only without it), and NCCL takes one
    GPU per rank: skip a layout this machine has too few GPUs for."""
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs where CUDA is present (NCCL)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    # 4 query heads in 2 groups: TP=2 splits whole groups (GQA), head_dim 32.
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def tp2(tiny, tmp_path_factory) -> tuple[dict, str]:
    """TP=2 x DP=2: four ranks, the distributed optimizer sharded over two DP ranks."""
    _gpus_for(4)
    work = tmp_path_factory.mktemp("tp2")
    report = asyncio.run(
        check_trainer_engine(
            "megatron", tiny, work, world_size=4, overrides=[*BASE, "trainer.megatron.tp=2"]
        )
    )
    return report, str(work / "checkpoint")  # saved after one step, at TP=2 x DP=2


@pytest.fixture(scope="module")
def pp2(tiny, tmp_path_factory) -> dict:
    _gpus_for(2)
    return asyncio.run(
        check_trainer_engine(
            "megatron",
            tiny,
            tmp_path_factory.mktemp("pp2"),
            world_size=2,
            overrides=[*BASE, "trainer.megatron.pp=2"],
        )
    )


def test_contract_tp2_dp2(tp2):
    report, _ = tp2
    assert report["logprobs_hf_max_diff"] < TOL
    assert report["export_initial_max_diff"] == 0.0


def test_contract_pp2(pp2):
    assert pp2["logprobs_after_step_hf_max_diff"] < TOL
    assert pp2["resumed_step_max_diff"] < TOL


def _lp_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)))


def test_tp1_tp2dp2_pp2_and_fsdp_agree(tiny, tp2, pp2, single, tmp_path):
    tp1 = single["tp1"]
    fsdp = asyncio.run(
        check_trainer_engine(
            "fsdp",
            tiny,
            tmp_path / "fsdp",
            overrides=["trainer.fsdp.lr=1e-3", "trainer.fsdp.micro_batch_tokens=40"],
        )
    )
    figures = {"tp2dp2": tp2[0], "pp2": pp2, "fsdp": fsdp}
    for name, other in figures.items():
        assert _lp_diff(tp1["logprobs"], other["logprobs"]) < TOL, name
        assert _lp_diff(tp1["logprobs_after_step"], other["logprobs_after_step"]) < TOL, name
        for k in ("loss", "pg_loss", "grad_norm", "trained_trajectories"):
            assert other["metrics"][k] == pytest.approx(tp1["metrics"][k], abs=TOL), (name, k)
    for name, r in {"tp1": tp1, **figures}.items():  # the figures, for the record (-s)
        m = r["metrics"]
        print(
            f"{name:6} loss {m['loss']:.9f} grad_norm {m['grad_norm']:.9f} "
            f"|lp - tp1| {_lp_diff(tp1['logprobs'], r['logprobs']):.2e} "
            f"after step {_lp_diff(tp1['logprobs_after_step'], r['logprobs_after_step']):.2e}"
        )


# -- vocabulary-parallel log-probs ----------------------------------------------------------
def _vocab_parallel_rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    from laminar_megatron.logprobs import vocab_parallel_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    vocab, padded = 100, 128  # columns 100..127 are padding: never a token's probability
    full = torch.randn(3, 7, padded, generator=g) * 3
    target = torch.randint(0, vocab, (3, 7), generator=g)
    weight = torch.randn(3, 7, generator=g)
    mine = full.chunk(2, -1)[rank].clone().requires_grad_(True)  # this rank's 64 columns
    lp = vocab_parallel_logprobs(mine / 0.7, target, vocab, dist.group.WORLD)
    (lp * weight).sum().backward()
    ref_in = full.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_in[..., :vocab] / 0.7, -1).gather(-1, target[..., None])[..., 0]
    (ref * weight).sum().backward()
    out[rank] = {
        "lp": (lp - ref).abs().max().item(),
        "grad": (mine.grad - ref_in.grad.chunk(2, -1)[rank]).abs().max().item(),
        "width": mine.shape[-1],
    }
    dist.destroy_process_group()


def test_vocab_parallel_logprobs_equal_the_gathered_ones():
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_vocab_parallel_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        assert out[r]["width"] == 64  # half the vocabulary per rank
        assert out[r]["lp"] < 1e-5 and out[r]["grad"] < 1e-5, out[r]


# -- one process, several engines: reshard, recompute, other families ------------------------
def _engine(model: str, **opts):
    from laminar_core import load_config
    from laminar_megatron import MegatronOptions
    from laminar_megatron.engine import MegatronTrainerEngine

    cfg = load_config(
        None, [f"model.path={model}", "model.dtype=float32", "rollout.temperature=0.7"]
    ).cfg
    return MegatronTrainerEngine(cfg, MegatronOptions(lr=1e-3, **opts)), cfg


async def _setup(eng, cfg) -> None:
    from laminar_core import TrainerContext

    init = f"tcp://127.0.0.1:{free_port()}"
    await eng.setup(TrainerContext(0, 1, eng.opt, cfg.algorithm, {"init_method": init}))


async def _saved_bytes(model: str, recompute: str) -> tuple[int, float, list[float]]:
    """Bytes of activations autograd keeps for backward over one forward (parameters not
    counted), the loss's gradient norm, and the log-probs."""
    eng, cfg = _engine(model, recompute=recompute)
    await _setup(eng, cfg)
    batch = contract_batch(128)
    trajs = [t for t in batch.trajectories if t.reward is not None]

    def run():
        from laminar_megatron import cpu_compat

        with cpu_compat.scope():
            params = {p.data_ptr() for p in eng.model.parameters()}
            mb = plan_micro_batches(trajs, list(range(len(trajs))), eng.batch_layout())[0]
            mask = response_mask(mb.spans)
            saved = 0

            def pack(t):
                nonlocal saved
                if t.data_ptr() not in params:
                    saved += t.numel() * t.element_size()
                return t

            eng.model.zero_grad_buffer()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = eng.model(*eng._inputs(mb))
            lp = responses(eng._token_logprobs(out, mb), mb.spans)
            (lp * mask).sum().backward()
            norm = sum(p.main_grad.double().pow(2).sum() for p in eng.model.parameters())
            return saved, float(norm.sqrt()), (lp * mask).sum(-1).tolist()

    try:
        return await asyncio.to_thread(run)
    finally:
        await eng.close()


def _tiny_llama(path) -> str:
    """Llama: untied head (exported as lm_head.weight), no biases, llama3 RoPE scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        max_position_embeddings=16384,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _tiny_qwen3(path) -> str:
    """Qwen3: per-head q/k RMSNorm, explicit head_dim, tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # q/k norms start at 1: make them count
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


async def _one_process(tiny: str, ckpt_tp2: str, work: str) -> dict:
    out: dict = {}
    out["tp1"] = await check_trainer_engine(
        "megatron", tiny, os.path.join(work, "tp1"), overrides=BASE
    )
    # a TP=2 checkpoint at TP=1
    eng, cfg = _engine(tiny)
    await _setup(eng, cfg)
    try:
        await eng.load_checkpoint(ckpt_tp2)
        out["resharded"] = await eng.compute_logprobs(contract_batch(128))
        out["resharded_version"] = eng.version
    finally:
        await eng.close()
    for mode in ("none", "full", "selective"):
        out[mode] = await _saved_bytes(tiny, mode)
    # multi-turn: tokens with loss mask 0 (a tool's output) count for nothing
    for name, garbage in (("plain", None), ("masked", None), ("masked_garbage", -50.0)):
        eng, cfg = _engine(tiny)
        await _setup(eng, cfg)
        try:
            batch = contract_batch(128)
            if name != "plain":
                _mask_every_third(batch, garbage)
            out[name] = dict(await eng.train_step(batch))
        finally:
            await eng.close()
    for name, build in (("llama", _tiny_llama), ("qwen3", _tiny_qwen3)):
        path = build(os.path.join(work, name))
        out[name] = await check_trainer_engine(
            "megatron", path, os.path.join(work, f"{name}-run"), overrides=BASE
        )
    return out


def _mask_every_third(batch, garbage: float | None) -> None:
    """Loss mask 0 on every third response token; ``garbage``: the rollout log-prob reported
    there (the contract says 0.0; anything must do)."""
    for t in batch.trajectories:
        if t.response_ids:
            t.loss_mask = [0 if j % 3 == 2 else 1 for j in range(len(t.response_ids))]
            if garbage is not None:
                t.logprobs = [lp if m else garbage for lp, m in zip(t.logprobs, t.loss_mask)]


def _one_process_main(tiny: str, ckpt: str, work: str, out: dict) -> None:
    torch.set_num_threads(1)
    out["result"] = asyncio.run(_one_process(tiny, ckpt, work))


@pytest.fixture(scope="module")
def single(tiny, tp2, tmp_path_factory) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    work = str(tmp_path_factory.mktemp("single"))
    p = ctx.Process(target=_one_process_main, args=(tiny, tp2[1], work, out))
    p.start()
    p.join(timeout=600)
    assert p.exitcode == 0, "the single-process engine checks failed (see the output above)"
    return out["result"]


def test_tp2_dp2_checkpoint_loads_at_tp1(tp2, single):
    report, _ = tp2
    # the checkpoint was saved right after the contract's first step
    assert _lp_diff(single["resharded"], report["logprobs_after_step"]) < TOL
    assert single["resharded_version"] == 1


def test_recompute_drops_saved_activations(single):
    none, full, selective = single["none"], single["full"], single["selective"]
    print(f"bytes saved for backward: none {none[0]} full {full[0]} selective {selective[0]}")
    assert full[0] < 0.5 * none[0], (full[0], none[0])  # only each layer's input is kept
    assert selective[0] < none[0], (selective[0], none[0])  # attention scores/probs re-run
    for other in (full, selective):  # and the maths is unchanged
        assert other[1] == pytest.approx(none[1], rel=1e-5)
        assert other[2] == pytest.approx(none[2], abs=1e-4)


def test_loss_mask_zero_tokens_count_for_nothing(single):
    """What the rollout reported at masked tokens moves nothing; masking changes the loss."""
    plain, masked, garbage = single["plain"], single["masked"], single["masked_garbage"]
    for key in ("loss", "pg_loss", "grad_norm"):
        assert garbage[key] == pytest.approx(masked[key], rel=1e-6, abs=1e-9), key
    assert masked["loss"] != pytest.approx(plain["loss"], rel=1e-3)


def test_llama_and_qwen3_pass_the_contract(single):
    for name in ("llama", "qwen3"):
        assert single[name]["logprobs_after_step_hf_max_diff"] < TOL, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path (NCCL, bf16)")
@pytest.mark.parametrize(("dtype", "tol"), [("float32", TOL), ("bfloat16", 0.05)])
def test_one_rank_on_cuda(tiny, tmp_path, dtype: str, tol: float):
    """One rank on a GPU: NCCL, megatron's CUDA buffers and (bf16) mixed precision keep the
    contract; bf16 log-probs within 0.05 of transformers' float32 ones (0.007 measured on
    an H100)."""
    report = asyncio.run(
        check_trainer_engine(
            "megatron", tiny, tmp_path, world_size=1, spawn=True,
            overrides=[*BASE, f"model.dtype={dtype}"], tolerance=tol,
        )
    )  # fmt: skip
    assert report["logprobs_after_step_hf_max_diff"] < tol
    assert report["metrics"]["trained_trajectories"] == 12.0


def test_layout_must_match_the_world_size():
    from laminar_megatron import MegatronOptions

    assert MegatronOptions(tp=2).layout(4) == (2, 1, 2)
    assert MegatronOptions(tp=2, pp=2, dp=1).layout(4) == (2, 2, 1)
    with pytest.raises(ValueError, match="does not match the trainer's world size 3"):
        MegatronOptions(tp=2).layout(3)
    with pytest.raises(ValueError, match="tp\\*pp\\*dp = 1\\*1\\*2"):
        MegatronOptions(dp=2).layout(4)


def test_options_are_validated_under_trainer_megatron():
    from laminar_core import ConfigError, load_config

    resolved = load_config(None, ["trainer.engine=megatron", "trainer.megatron.tp=2"])
    assert resolved.engine_options["trainer"].tp == 2
    with pytest.raises(ConfigError, match=r"trainer\.megatron.*recompute: unknown 'fulll'"):
        load_config(None, ["trainer.engine=megatron", "trainer.megatron.recompute=fulll"])
