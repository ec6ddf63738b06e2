"""Core's share of every trainer step (``laminar_core.training``), on a bigram model in plain
torch (no transformers, no processes):

- micro-batch layouts: packed rows hold only real tokens, positions restart per trajectory,
  labels never cross a trajectory, and both layouts point at the same response tokens;
- the step driven through ``ModelTrainerEngine``'s hooks is the batch-level objective: the loss
  and the gradient over several micro-batches (and over data-parallel groups, summed) equal
  core's ``policy_loss`` on the whole batch at once, for every loss aggregation;
- mini-batches: one update each, metrics averaged over them, the log-prob gap measured before
  the first update on the trajectories the held version generated;
- the shared rules: failed trajectories and ones whose log-probs or loss mask do not match the
  response are left out; loss-mask 0 tokens count for nothing;
- an engine that breaks the hooks' contract gets an error naming the fix.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from laminar_core import FinishReason, TrainBatch, load_config
from laminar_core.algorithms import compute_advantages, policy_loss
from laminar_core.testing import contract_batch
from laminar_core.training import (
    BatchLayout,
    ModelTrainerEngine,
    collate,
    collate_packed,
    empty_micro_batch,
    pack_bins,
    padded,
    plan_micro_batches,
    response_mask,
    responses,
    trainable,
)

PAD, VOCAB = 0, 32


def _batch(seed: int = 0, version: int = 0) -> TrainBatch:
    """The kit's batch (three groups of four, one failed trajectory) with random rewards and
    behaviour log-probs."""
    batch = contract_batch(VOCAB, version, seed)
    rng = random.Random(seed)
    for t in batch.trajectories:
        t.logprobs = [rng.uniform(-4.0, -3.0) for _ in t.response_ids]
        t.reward = rng.random()
    return batch


# -- layouts ----------------------------------------------------------------------------------
def test_pack_bins_fill_to_the_budget_in_real_tokens():
    lengths = [9, 3, 7, 2, 12, 5]
    bins = pack_bins(lengths, list(range(6)), 12)
    assert sorted(i for b in bins for i in b) == list(range(6))  # each index exactly once
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert len(bins) == 4  # 38 tokens: first-fit decreasing needs ceil(38/12) = 4
    assert pack_bins([20, 3], [0, 1], 8) == [[0], [1]]  # too long: a bin of its own
    assert pack_bins(lengths, [5, 1, 3], 100) == [[1, 3, 5]]


def test_packed_row_restarts_positions_and_keeps_labels_inside_trajectories():
    trajs = trainable(_batch().trajectories)
    index = [0, 2, 4]
    mb = collate_packed(trajs, index, PAD, multiple=4)
    seqs = [list(trajs[i].prompt_ids) + list(trajs[i].response_ids) for i in index]
    real = sum(map(len, seqs))
    assert mb.input_ids.shape == (1, real + (-real % 4))  # padding only to the SP multiple
    assert mb.attention_mask is None and mb.packed and mb.real_tokens == real
    assert mb.cu_seqlens[: len(index) + 1] == [
        0,
        *torch.tensor(list(map(len, seqs))).cumsum(0).tolist(),
    ]
    start = 0
    for s in seqs:
        assert mb.input_ids[0, start : start + len(s)].tolist() == s
        assert mb.position_ids[0, start : start + len(s)].tolist() == list(range(len(s)))
        assert mb.labels[0, start : start + len(s) - 1].tolist() == s[1:]
        start += len(s)


def test_both_layouts_select_the_same_response_tokens():
    trajs = trainable(_batch().trajectories)
    index = [1, 3, 5]
    for mb in (collate(trajs, index, PAD), collate_packed(trajs, index, PAD, multiple=2)):
        got = responses(mb.labels.float(), mb.spans)  # the label at a response column
        want = padded([trajs[i].response_ids for i in index], got.shape[1])
        torch.testing.assert_close(got, want)
        assert response_mask(mb.spans).sum() == sum(len(trajs[i].response_ids) for i in index)
        assert mb.num_tokens == sum(len(trajs[i].response_ids) for i in index)


def test_empty_micro_batch_has_nothing_to_learn():
    for packed in (True, False):
        mb = empty_micro_batch(PAD, packed, multiple=4)
        assert mb.index == [] and mb.num_tokens == 0 and mb.input_ids.shape[1] % 4 == 0


def test_plan_splits_over_groups_and_keeps_them_in_step():
    trajs = trainable(_batch().trajectories)
    chunk = list(range(len(trajs)))
    base = BatchLayout(torch.device("cpu"), PAD, token_budget=16, packed=True, dp_size=2)
    plans = [plan_micro_batches(trajs, chunk, replace(base, dp_rank=r)) for r in range(2)]
    held = sorted(i for p in plans for mb in p for i in mb.index)
    assert held == chunk  # every trajectory on exactly one group
    assert len(plans[0]) == len(plans[1])  # lockstep: the shorter plan runs empty ones
    assert all(mb.real_tokens <= 16 or len(mb.index) == 1 for p in plans for mb in p)
    # not in lockstep: a group with nothing runs one empty micro-batch
    lone = replace(base, dp_size=3, dp_rank=2, lockstep=False)
    (mb,) = plan_micro_batches(trajs, [0, 1], lone)
    assert mb.index == []


# -- the step, through the hooks ----------------------------------------------------------------
class Bigram(ModelTrainerEngine):
    """The smallest model: the next token's logits from the current token alone (so packed
    and padded rows give the same numbers). Plain torch, one rank, SGD."""

    def __init__(self, config, budget: int = 24, packed: bool = True, **layout) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
        self.optim = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.layout = BatchLayout(torch.device("cpu"), PAD, budget, packed, **layout)
        self.losses: list[float] = []

    async def setup(self, ctx) -> None: ...
    async def export_weights(self):  # pragma: no cover - not used here
        yield "w", self.net[1].weight

    async def save_checkpoint(self, directory: str) -> None: ...
    async def load_checkpoint(self, directory: str) -> None: ...
    async def close(self) -> None: ...

    def batch_layout(self) -> BatchLayout:
        return self.layout

    def _logprobs(self, mb):
        logits = self.net(mb.input_ids) / float(self.cfg.rollout.temperature)
        lp = torch.log_softmax(logits, -1).gather(-1, mb.labels[..., None])[..., 0]
        return responses(lp, mb.spans)

    def forward(self, micro_batches):
        return [self._logprobs(mb) for mb in micro_batches]

    def forward_backward(self, micro_batches, loss_fn) -> None:
        self.optim.zero_grad()
        for mb in micro_batches:
            if mb.index:
                loss = loss_fn(mb, self._logprobs(mb), None)
                self.losses.append(float(loss.detach()))
                loss.backward()

    def optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1e9)
        self.optim.step()
        return norm

    def learning_rate(self) -> float:
        return self.optim.param_groups[0]["lr"]


def _cfg(*extra: str):
    base = ["rollout.temperature=0.7", "rollout.max_tokens=16", "trainer.mini_batches=1"]
    return load_config(None, [*base, *extra]).cfg


def _reference(cfg, batch: TrainBatch) -> tuple[float, dict[str, torch.Tensor]]:
    """Core's ``policy_loss`` over the whole batch at once, and its gradient."""
    eng = Bigram(cfg)
    trajs = trainable(batch.trajectories)
    gids = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    adv = compute_advantages(
        cfg.algorithm.advantage,
        torch.tensor([t.reward for t in trajs]),
        torch.tensor([gids[t.group_id] for t in trajs]),
    )
    mb = collate(trajs, list(range(len(trajs))), PAD)
    lp = eng._logprobs(mb)
    width = lp.shape[1]
    mask = padded([t.response_mask() for t in trajs], width)
    behaviour = padded([t.logprobs for t in trajs], width)
    loss, _ = policy_loss(cfg.algorithm, lp, behaviour, adv, mask, max_len=16)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in eng.net.named_parameters()}


def _grads(eng: Bigram) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in eng.net.named_parameters()}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("packed", [True, False])
def test_micro_batches_and_groups_sum_to_the_batch_objective(agg: str, packed: bool):
    cfg = _cfg(f"algorithm.loss_agg={agg}")
    batch = _batch()
    for t in batch.trajectories[1::3]:  # some tool tokens: loss mask 0
        t.loss_mask = [0 if j % 2 else 1 for j in range(len(t.response_ids))]
    want_loss, want_grads = _reference(cfg, batch)
    eng = Bigram(cfg, budget=12, packed=packed)  # several micro-batches
    metrics = asyncio.run(eng.train_step(batch))
    assert len(eng.losses) > 2
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["trained_trajectories"] == 12.0  # the failed one is left out
    got = _grads(eng)
    for name, g in want_grads.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
    # two data-parallel groups (no process group here): their gradients sum to the batch's
    groups = [Bigram(cfg, budget=12, packed=packed, dp_size=2, dp_rank=r) for r in range(2)]
    for g in groups:
        asyncio.run(g.train_step(batch))
    assert all(g.losses for g in groups)
    for name, g in want_grads.items():
        total = sum(_grads(e)[name] for e in groups)
        torch.testing.assert_close(total, g, atol=1e-6, rtol=1e-4, msg=name)


def test_mini_batches_average_metrics_and_measure_the_gap_before_the_first_update():
    cfg = _cfg("trainer.mini_batches=2")
    batch = _batch(version=3)
    batch.version = 3  # the weights held were published as version 3
    batch.trajectories[1].version = 2  # generated by another version: not in the gap
    eng = Bigram(cfg, budget=12)
    lps = asyncio.run(eng.compute_logprobs(batch))
    chunks = [list(range(6)), list(range(6, 12))]  # trainable order: the failed one is out
    m = asyncio.run(eng.train_step(batch))
    assert eng.version == 1 and m["lr"] == 0.1
    trajs = trainable(batch.trajectories)
    first = [t for t in (trajs[i] for i in chunks[0]) if t.traj_id != "g0-1"]
    lp_of = {t.traj_id: lp for t, lp in zip(batch.trajectories, lps, strict=True)}
    diffs = [abs(a - b) for t in first for a, b in zip(lp_of[t.traj_id], t.logprobs)]
    assert m["logprob_diff_tokens"] == len(diffs)
    assert m["logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert m["logprob_abs_diff_max"] == pytest.approx(max(diffs), rel=1e-5)
    # the loss is the mean of the two updates' losses (each the sum of its micro-batches')
    assert set(m) >= {"loss", "pg_loss", "clip_fraction", "ratio_mean", "grad_norm"}


def test_compute_logprobs_then_off_policy_correction():
    cfg = _cfg("algorithm.off_policy=tis", "trainer.mini_batches=2")
    batch = _batch()
    eng = Bigram(cfg, budget=12)
    with pytest.raises(RuntimeError, match="needs compute_logprobs before train_step"):
        asyncio.run(eng.train_step(batch))
    eng = Bigram(cfg, budget=12)
    lps = asyncio.run(eng.compute_logprobs(batch))
    assert [len(x) for x in lps] == [
        len(t.response_ids) if t.finish_reason != FinishReason.FAILED else 0
        for t in batch.trajectories
    ]
    m = asyncio.run(eng.train_step(batch))
    assert "is_weight_mean" in m and m["trained_trajectories"] == 12.0
    assert "is_masked_fraction" not in m
    # masked IS: the band drops tokens (a narrow one, so some are) and the step says how many
    cfg = _cfg(
        "algorithm.off_policy=tis",
        "algorithm.is_mask=token",
        "algorithm.mask_low=0.99",
        "algorithm.mask_high=1.01",
    )
    eng = Bigram(cfg, budget=12)
    asyncio.run(eng.compute_logprobs(batch))
    m = asyncio.run(eng.train_step(batch))
    assert 0 < m["is_masked_fraction"] <= 1


def test_loss_mask_zero_tokens_count_for_nothing_and_bad_masks_are_left_out():
    cfg = _cfg()

    def run(garbage: float | None, bad_mask: bool = False) -> tuple[dict, dict]:
        batch = _batch()
        for t in batch.trajectories:
            t.loss_mask = [0 if j % 3 == 2 else 1 for j in range(len(t.response_ids))]
            if garbage is not None:
                t.logprobs = [lp if m else garbage for lp, m in zip(t.logprobs, t.loss_mask)]
        if bad_mask:
            batch.trajectories[2].loss_mask.append(1)  # one entry too many
        eng = Bigram(cfg, budget=12)
        return asyncio.run(eng.train_step(batch)), _grads(eng)

    (masked, g1), (garbage, g2) = run(None), run(-50.0)
    for k in ("loss", "pg_loss", "grad_norm", "logprob_abs_diff_mean"):
        assert garbage[k] == pytest.approx(masked[k], rel=1e-6), k
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name])
    bad, _ = run(None, bad_mask=True)
    assert bad["trained_trajectories"] == masked["trained_trajectories"] - 1 == 11.0


class _PerPosition(Bigram):
    """Returns per-position log-probs, not per-trajectory response rows."""

    def forward(self, micro_batches):
        return [torch.zeros(mb.input_ids.shape) for mb in micro_batches]


class _SkipsLoss(Bigram):
    """Runs the first micro-batch only."""

    def forward_backward(self, micro_batches, loss_fn) -> None:
        super().forward_backward(micro_batches[:1], loss_fn)


def test_an_engine_breaking_the_hooks_gets_the_fix_named():
    cfg = _cfg()
    with pytest.raises(ValueError, match=r"laminar_core\.training\.responses\(per_position"):
        asyncio.run(_PerPosition(cfg, budget=12).compute_logprobs(_batch()))
    with pytest.raises(RuntimeError, match=r"called loss_fn 1 times for \d+ micro-batches"):
        asyncio.run(_SkipsLoss(cfg, budget=12).train_step(_batch()))


@pytest.mark.parametrize(
    ("loss", "agg"),
    [("gspo", "seq_mean_token_mean"), ("gspo", "token_mean"), ("cispo", "token_mean")],
)
def test_every_loss_sums_over_micro_batches_to_the_batch_objective(loss: str, agg: str):
    # a sequence-level ratio (GSPO) needs each trajectory whole in one micro-batch: it is
    cfg = _cfg(f"algorithm.loss={loss}", f"algorithm.loss_agg={agg}")
    batch = _batch()
    want_loss, want_grads = _reference(cfg, batch)
    ppo_loss, _ = _reference(_cfg(f"algorithm.loss_agg={agg}"), batch)
    assert want_loss != pytest.approx(ppo_loss)  # the loss is not PPO's
    eng = Bigram(cfg, budget=12, packed=True)
    metrics = asyncio.run(eng.train_step(batch))
    assert len(eng.losses) > 2
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(_grads(eng)[name], g, atol=1e-6, rtol=1e-4, msg=name)
