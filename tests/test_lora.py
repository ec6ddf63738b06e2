"""LoRA in core: ``trainer.lora``'s checks (values, and engines that cannot train or
hot-load adapters), the adapter layer (starts as the base model, trains only A and B, merges
to the same function) and PEFT's adapter files."""

from __future__ import annotations

import json

import pytest
import torch

from laminar_core import load_config
from laminar_core.config.loader import ConfigError
from laminar_core.models import build_tiny_model
from laminar_core.training import (
    LoRALinear,
    LoRASpec,
    adapter_tensors,
    apply_lora,
    merge_into,
    read_adapter,
    write_adapter,
)

REAL = ["trainer.engine=fsdp", "rollout.engine=vllm", "cluster.gpus=2", "cluster.trainer_gpus=1"]
SPEC = LoRASpec(4, 8.0, 0.0, ("q_proj", "down_proj"))


def test_rank_zero_is_full_fine_tuning_and_the_default():
    cfg = load_config(None, []).cfg
    assert cfg.trainer.lora.rank == 0 and LoRASpec.of(cfg.trainer.lora) is None
    cfg = load_config(None, [*REAL, "trainer.lora.rank=8"]).cfg
    assert LoRASpec.of(cfg.trainer.lora) == LoRASpec(
        8, 16.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=-1"], "trainer.lora.rank must be >= 0"),
        (["trainer.lora.rank=8", "trainer.lora.dropout=1.0"], "trainer.lora.dropout"),
        (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha must be > 0"),
        (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "at least one linear"),
        (["trainer.lora.rank=8", "trainer.lora.target_modules=[lm_head]"], "not decoder linear"),
    ],
)
def test_bad_lora_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [*REAL, *overrides])
    assert "\n" not in str(e.value)


def test_engines_that_cannot_train_or_hot_load_adapters_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"cannot train LoRA adapters; set trainer.engine to one "
        r"that can \(.*fsdp.*megatron",
    ):
        load_config(None, ["trainer.lora.rank=8"])  # the simulated trainer
    with pytest.raises(
        ConfigError, match=r"rollout\.engine=sim cannot hot-load LoRA.*sglang.*vllm"
    ):
        load_config(None, [*REAL, "rollout.engine=sim", "trainer.lora.rank=8"])
    load_config(None, [*REAL, "trainer.lora.rank=8"])  # fsdp + vllm
    load_config(
        None, [*REAL, "trainer.engine=megatron", "rollout.engine=sglang", "trainer.lora.rank=8"]
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def _lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_apply_lora_starts_as_the_base_model_and_trains_only_adapters(tiny):
    base, lm = _lm(tiny), _lm(tiny)
    names = apply_lora(lm, SPEC)
    layers = lm.config.num_hidden_layers
    assert len(names) == 2 * layers
    assert all(isinstance(lm.get_submodule(n), LoRALinear) for n in names)
    trained = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert len(trained) == 4 * layers and all(".lora_" in n for n in trained)
    # the base weights keep their names (checkpoints, full exports, merges use them)
    assert {n for n, _ in base.named_parameters()} <= {n for n, _ in lm.named_parameters()}
    ids = torch.tensor([[3, 7, 11, 5, 9]])
    with torch.no_grad():
        assert torch.equal(base(ids).logits, lm(ids).logits)  # B starts at zero
    (name, _a), (_, _b) = adapter_tensors(lm)[:2]
    assert name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_merge_and_peft_files_round_trip(tiny, tmp_path):
    lm = _lm(tiny)
    apply_lora(lm, SPEC)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in adapter_tensors(lm):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    d = write_adapter(tmp_path / "adapter", adapter_tensors(lm), SPEC, base_model=tiny)
    conf = json.loads((d / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["target_modules"] == ["down_proj", "q_proj"]
    spec, tensors = read_adapter(d)
    assert spec == LoRASpec(4, 8.0, 0.0, ("down_proj", "q_proj"))
    assert set(tensors) == {n for n, _ in adapter_tensors(lm)}
    merged = _lm(tiny)
    with torch.no_grad():
        state = dict(merge_into(merged.state_dict().items(), tensors, spec))
        merged.load_state_dict(state)
        ids = torch.tensor([[3, 7, 11, 5, 9]])
        assert torch.allclose(merged(ids).logits, lm(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, _lm(tiny)(ids).logits, atol=1e-3)


def test_bad_targets_and_ranks_name_the_fix(tiny):
    with pytest.raises(ValueError, match=r"'qproj' matches no linear layer.*q_proj"):
        apply_lora(_lm(tiny), LoRASpec(4, 8.0, 0.0, ("qproj",)))
    with pytest.raises(ValueError, match=r"rank=4096 is above the width.*use a rank <="):
        apply_lora(_lm(tiny), LoRASpec(4096, 8.0, 0.0, ("q_proj",)))


def test_repeat_warmup_knows_the_format_not_the_count():
    """The base model of examples/lora.yaml is warmed up on these: the prompt's letter only,
    a share of them exact, the rest off by a factor in [0.5, 1.5]."""
    import itertools
    import re

    from laminar_core.models.warmup import WARMUPS

    demos = list(itertools.islice(WARMUPS["repeat"](0, 0.2), 400))
    exact = 0
    for d in demos:
        letter, count = re.fullmatch(r"([a-z])\*(\d+)=", d.prompt).groups()
        ((text, trained),) = d.segments
        assert trained and set(text) == {letter}
        assert 0.5 * int(count) - 1 <= len(text) <= 1.5 * int(count) + 1
        exact += len(text) == int(count)
    assert 0.15 < exact / len(demos) < 0.45  # 20% exact, plus near misses that round to it
    with pytest.raises(ValueError, match="exact_share must be in"):
        next(WARMUPS["repeat"](0, 1.5))


def test_repeat_warmup_can_skip_the_held_out_pairs():
    """``holdout`` skips the (letter, count) pairs a task with that holdout evaluates on (a
    student warmed on the rest is still tested on pairs it never saw: benchmarks/distill.py);
    0 leaves the stream as it was."""
    import itertools

    from laminar_core.models.warmup import repeat_demonstrations
    from laminar_core.tasks.repeat import RepeatTask

    held = {r["prompt"] for r in itertools.islice(RepeatTask(holdout=0.1, split="eval"), 200)}
    full = [d.prompt for d in itertools.islice(repeat_demonstrations(0, 1.0), 2000)]
    kept = [d.prompt for d in itertools.islice(repeat_demonstrations(0, 1.0, 0.1), 2000)]
    assert held & set(full) and not held & set(kept)
    # held-out prompts are a tenth of the pairs but mostly frequent ones (c*3, a*5)
    assert len(set(kept)) > 0.8 * len(set(full))
    with pytest.raises(ValueError, match="holdout must be in"):
        next(repeat_demonstrations(0, 1.0, 1.0))
