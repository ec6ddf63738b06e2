"""The policy losses (ppo, gspo, cispo) and the rollout corrections (IS levels, band masks)
against plain reference implementations: per-sequence Python loops over scalars, written from
the papers' formulas, compared in value and in gradient (autograd through the loops) for every
advantage estimator and loss aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from laminar_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSSES,
    AlgorithmConfig,
    cispo_loss,
    compute_advantages,
    gspo_loss,
    is_band_mask,
    is_weights,
    policy_loss,
    validate_algorithm,
    zero_variance,
)

MAX_LEN = 8


def data(seed: int = 0, b: int = 6, t: int = 5):
    """Random log-probs near each other (ratios within ~[0.6, 1.6]), ragged masks (one row
    empty), rewards of 3 groups of 2, and -inf in the padding."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    old = behaviour + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.6
    new = old + (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 0.8
    lengths = [5, 3, 1, 4, 0, 2][:b]
    mask = torch.zeros(b, t)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    for x in (behaviour, old, new):
        x.masked_fill_(mask == 0, -math.inf)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0][:b], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2][:b])
    return new, old, behaviour, mask, rewards, groups


def rows(mask):
    return [[j for j in range(mask.shape[1]) if mask[i, j]] for i in range(mask.shape[0])]


def ref_aggregate(per_token: list[list[torch.Tensor]], agg: str) -> torch.Tensor:
    """``per_token[i]``: sequence i's token terms (scalars)."""
    zero = torch.zeros((), dtype=torch.float64)
    nonempty = [r for r in per_token if r]
    if agg == "token_mean":
        n = sum(len(r) for r in per_token)
        return sum((x for r in per_token for x in r), zero) / max(n, 1)
    if agg == "seq_mean_token_mean":
        return sum((sum(r, zero) / len(r) for r in nonempty), zero) / max(len(nonempty), 1)
    return sum((sum(r, zero) / MAX_LEN for r in nonempty), zero) / max(len(nonempty), 1)


def clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def ref_loss(kind, new, old, adv, mask, cl, ch, agg, w=None):
    terms = []
    for i, cols in enumerate(rows(mask)):
        a = float(adv[i])
        seq = []
        if kind == "gspo" and cols:
            s = torch.exp(sum(new[i, j] - old[i, j] for j in cols) / len(cols))
            li = -torch.minimum(s * a, clip(s, 1 - cl, 1 + ch) * a)
        for j in cols:
            wt = 1.0 if w is None else float(w[i, j])
            r = torch.exp(new[i, j] - old[i, j])
            if kind == "ppo":
                x = -torch.minimum(r * a, clip(r, 1 - cl, 1 + ch) * a)
            elif kind == "gspo":
                x = li
            else:  # cispo: -sg(clip(r)) * A * log pi
                x = -clip(r.detach(), 1 - cl, 1 + ch) * a * new[i, j]
            seq.append(x * wt)
        terms.append(seq)
    return ref_aggregate(terms, agg)


def ref_is(target, behaviour, mask, level, cap=None):
    w = torch.zeros_like(target)
    for i, cols in enumerate(rows(mask)):
        d = [float(target[i, j] - behaviour[i, j]) for j in cols]
        for k, j in enumerate(cols):
            if level == "token":
                x = math.exp(d[k])
            elif level == "sequence":
                x = math.exp(sum(d))
            else:
                x = math.exp(sum(d) / len(d))
            w[i, j] = x if cap is None else min(x, cap)
    return w


def grads(fn, new):
    x = new.clone().requires_grad_(True)
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), torch.nan_to_num(g, nan=0.0)


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("kind", LOSSES)
def test_losses_match_the_reference(kind, estimator, agg):
    new, old, _behaviour, mask, rewards, groups = data()
    adv = compute_advantages(estimator, rewards, groups)
    # GSPO's clip range is per mille (the paper's 3e-4/4e-4 would clip everything here)
    cl, ch = (0.05, 0.08) if kind == "gspo" else (0.2, 0.28)
    cfg = AlgorithmConfig(loss=kind, loss_agg=agg, clip_low=cl, clip_high=ch)
    got, g_got = grads(
        lambda x: policy_loss(cfg, x, old, adv, mask, max_len=MAX_LEN)[0], new
    )  # off_policy none: the ratio is against the behaviour log-probs passed
    want, g_want = grads(lambda x: ref_loss(kind, x, old, adv, mask, cl, ch, agg), new)
    assert_close(got, want)
    assert_close(g_got, g_want)
    assert torch.isfinite(g_got).all()


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_gspo_with_sequence_level_weights_is_gspo_exactly(level, agg):
    # a weight constant over the sequence keeps the GSPO-token form equal to GSPO itself
    new, old, behaviour, mask, rewards, groups = data(1)
    adv = compute_advantages("grpo", rewards, groups)
    w = ref_is(old, behaviour, mask, level, cap=2.0)
    got, g_got = grads(lambda x: gspo_loss(x, old, adv, mask, 0.05, 0.08, agg, w, MAX_LEN)[0], new)
    want, g_want = grads(lambda x: ref_loss("gspo", x, old, adv, mask, 0.05, 0.08, agg, w), new)
    assert_close(got, want)
    assert_close(g_got, g_want)


def test_gspo_clips_whole_sequences_and_cispo_never_drops_a_gradient():
    # one sequence, ratios exp(.5) and exp(-.1): geometric mean exp(.2) > 1 + .1 with A > 0
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2)
    loss, m = gspo_loss(new, old, torch.tensor([1.0]), mask, 0.1, 0.1)
    loss.backward()
    assert new.grad.abs().sum() == 0  # clipped: the whole sequence gives no gradient
    assert m["clip_fraction"] == 1.0
    assert m["ratio_mean"] == pytest.approx(math.exp(0.2))
    new.grad = None
    loss, m = cispo_loss(new, old, torch.tensor([1.0]), mask, 0.1, 0.1)
    loss.backward()
    # weights clip(e^.5) = 1.1 and e^-.1 (inside): gradient -w * A / 2 on each token
    assert_close(new.grad, torch.tensor([[-1.1 / 2, -math.exp(-0.1) / 2]], dtype=torch.float64))
    assert m["clip_high_fraction"] == 0.5 and m["clip_low_fraction"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_is_weights_match_the_reference(level):
    _new, old, behaviour, mask, *_ = data(2)
    assert_close(is_weights(old, behaviour, mask, level), ref_is(old, behaviour, mask, level))
    assert_close(
        is_weights(old, behaviour, mask, level, cap=1.1), ref_is(old, behaviour, mask, level, 1.1)
    )


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_band_masks_match_the_reference(level):
    _new, old, behaviour, mask, *_ = data(3)
    low, high = 0.9, 1.15
    rho = ref_is(old, behaviour, mask, level)
    want = (mask > 0) & (rho >= low) & (rho <= high)
    got = is_band_mask(old, behaviour, mask, level, low, high)
    assert torch.equal(got, want)
    assert 0 < got.sum() < mask.sum()  # the band cuts: the test can tell


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("masking", ["none", "token", "sequence", "geometric"])
def test_policy_loss_applies_weights_and_mask(level, masking):
    new, old, behaviour, mask, rewards, groups = data(4)
    adv = compute_advantages("grpo", rewards, groups)
    cfg = AlgorithmConfig(
        off_policy="tis", is_level=level, is_mask=masking, mask_low=0.88, mask_high=1.25
    )
    w = ref_is(old, behaviour, mask, level, cfg.is_cap)
    if masking != "none":
        rho = ref_is(old, behaviour, mask, masking)
        keep = (mask > 0) & (rho >= 0.88) & (rho <= 1.25)
        w = w * keep
    got, g_got = grads(
        lambda x: policy_loss(cfg, x, behaviour, adv, mask, old_logprobs=old)[0], new
    )
    want, g_want = grads(
        lambda x: ref_loss("ppo", x, old, adv, mask, 0.2, 0.28, "token_mean", w), new
    )
    assert_close(got, want)
    assert_close(g_got, g_want)
    _, metrics = policy_loss(cfg, new, behaviour, adv, mask, old_logprobs=old)
    if masking == "none":
        assert "is_masked_fraction" not in metrics
    else:
        dropped = float(((mask > 0) & ~keep).sum() / mask.sum())
        assert metrics["is_masked_fraction"] == pytest.approx(dropped)
        assert 0 < dropped < 1


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"loss": "gpso"}, ["algorithm.loss", "'gpso'", "did you mean 'gspo'", "cispo"]),
        ({"is_level": "seq"}, ["algorithm.is_level", "geometric"]),
        ({"is_mask": "tokens"}, ["algorithm.is_mask", "did you mean 'token'"]),
        ({"off_policy": "tis", "mask_low": 1.2}, ["mask_low/mask_high", "must hold 1"]),
        ({"off_policy": "tis", "mask_high": 0.9}, ["mask_low/mask_high", "must hold 1"]),
        ({"is_mask": "token"}, ["algorithm.is_mask", "off_policy to tis or decoupled"]),
        ({"is_level": "sequence"}, ["algorithm.is_level", "off_policy to tis or decoupled"]),
        (
            {"off_policy": "decoupled", "is_level": "sequence", "is_cap": None},
            ["algorithm.is_cap", "sequence", "set a cap"],
        ),
        ({"dynamic_sampling": "yes"}, ["algorithm.dynamic_sampling", "true, false or a mapping"]),
        ({"dynamic_sampling": {"max_rate": 0}}, ["dynamic_sampling.max_rate", "(0, 1]"]),
        ({"dynamic_sampling": {"patiense": 3}}, ["did you mean 'patience'"]),
        (
            {"dynamic_sampling": {"filter": "zero_var"}},
            ["dynamic_sampling.filter", "zero_variance"],
        ),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(overrides, words):
    with pytest.raises(ValueError) as err:
        validate_algorithm(AlgorithmConfig(**overrides))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_zero_variance():
    assert zero_variance([1.0, 1.0, 1.0]) and zero_variance([0.0]) and zero_variance([])
    assert not zero_variance([1.0, 0.0, 1.0])
