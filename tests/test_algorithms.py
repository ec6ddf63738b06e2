"""Tests for laminar_core.algorithms against hand-computed numbers.

Expected values are worked out in the comments and written as literals; nothing here
re-implements the formulas under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from laminar_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    AlgorithmConfig,
    aggregate,
    compute_advantages,
    dr_grpo,
    grpo,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    reinforce_pp,
    rloo,
    truncated_is_weights,
    validate_algorithm,
)
from laminar_core.algorithms import advantages as adv_mod

LN_HALF = -0.6931471805599453  # ln 0.5
LN_1_1 = 0.09531017980432493  # ln 1.1
LN_1_5 = 0.4054651081081644  # ln 1.5
LN_3 = 1.0986122886681098  # ln 3
INF = float("inf")
NAN = float("nan")


def t(values, **kw) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, **kw)


# --------------------------------------------------------------------------- advantages

# Two groups in order: group 0 = [1, 0, 1, 1], group 1 = [0, 0].
R_BASIC = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
G_BASIC = torch.tensor([0, 0, 0, 0, 1, 1])

# Interleaved groups with non-contiguous ids and different sizes:
#   id 7 -> positions 0, 2, 4 with rewards [2, 0, 1]
#   id 3 -> positions 1, 3    with rewards [1, 3]
#   id 9 -> position 5        with reward  [5]   (size-1 group)
R_MIXED = t([2.0, 1.0, 0.0, 3.0, 1.0, 5.0])
G_MIXED = torch.tensor([7, 3, 7, 3, 7, 9])


def test_grpo_basic():
    # group 0: mean 0.75, deviations [.25, -.75, .25, .25], sum sq = 3*.0625 + .5625 = .75,
    #   unbiased var = .75 / 3 = .25, std = .5 -> [.5, -1.5, .5, .5]
    # group 1: all equal -> deviations 0 -> [0, 0]
    out = grpo(R_BASIC, G_BASIC)
    assert out.dtype == torch.float32
    assert_close(out, t([0.5, -1.5, 0.5, 0.5, 0.0, 0.0]))


def test_grpo_interleaved_and_singleton():
    # id 7: mean 1, dev [1, -1, 0], sum sq 2, var 2/2 = 1, std 1 -> [1, -1, 0]
    # id 3: mean 2, dev [-1, 1], sum sq 2, var 2/1 = 2, std sqrt 2 -> [-1/sqrt2, 1/sqrt2]
    # id 9: size 1 -> 0
    s = 0.7071067811865475
    assert_close(grpo(R_MIXED, G_MIXED), t([1.0, -s, -1.0, s, 0.0, 0.0]))
    # without std normalisation it is the plain deviation from the group mean
    assert_close(grpo(R_MIXED, G_MIXED, std_normalize=False), t([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))


def test_grpo_eps_and_all_singletons():
    # a single group [0, 2]: mean 1, dev [-1, 1], var 2, std sqrt2 ~ 1.41421; eps=1 ->
    # [-1, 1] / 2.41421 = [-0.41421, 0.41421]
    assert_close(grpo(t([0.0, 2.0]), torch.tensor([4, 4]), eps=1.0), t([-0.41421356, 0.41421356]))
    # every group of size 1 -> all zeros, no NaN
    assert_close(grpo(t([3.0, -2.0, 7.0]), torch.tensor([0, 1, 2])), t([0.0, 0.0, 0.0]))


def test_grpo_is_permutation_equivariant_on_a_large_batch():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (8192,), generator=gen).float()
    groups = torch.randint(0, 1000, (8192,), generator=gen)
    perm = torch.randperm(8192, generator=gen)
    base = grpo(rewards, groups)
    assert torch.isfinite(base).all()
    assert_close(grpo(rewards[perm], groups[perm]), base[perm])


def test_dr_grpo():
    # group 0 mean .75 -> [.25, -.75, .25, .25]; group 1 -> [0, 0]
    assert_close(dr_grpo(R_BASIC, G_BASIC), t([0.25, -0.75, 0.25, 0.25, 0.0, 0.0]))
    # id 7 mean 1 -> [1, -1, 0]; id 3 mean 2 -> [-1, 1]; id 9 -> 0
    assert_close(dr_grpo(R_MIXED, G_MIXED), t([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))


def test_rloo():
    # group 0 [1, 0, 1, 1]: a 1 sees others [0, 1, 1] mean 2/3 -> 1/3; the 0 sees [1,1,1] -> -1
    third = 1.0 / 3.0
    assert_close(rloo(R_BASIC, G_BASIC), t([third, -1.0, third, third, 0.0, 0.0]))
    # id 7 [2, 0, 1]: 2 - mean(0, 1) = 1.5; 0 - mean(2, 1) = -1.5; 1 - mean(2, 0) = 0
    # id 3 [1, 3]: 1 - 3 = -2; 3 - 1 = 2;  id 9: size 1 -> 0
    assert_close(rloo(R_MIXED, G_MIXED), t([1.5, -2.0, -1.5, 2.0, 0.0, 0.0]))


def test_reinforce_pp_global_whitening():
    # all six rewards: mean .5, deviations +-.5, sum sq 1.5, unbiased var 1.5/5 = .3,
    # std .5477226 -> +-.5 / .5477226 = +-0.9128709  (group ids ignored without baseline)
    a = 0.9128709291752769
    expected = t([a, -a, a, a, -a, -a])
    assert_close(reinforce_pp(R_BASIC), expected)
    assert_close(reinforce_pp(R_BASIC, G_BASIC), expected)


def test_reinforce_pp_baseline():
    # group-mean subtraction first: [.25, -.75, .25, .25, 0, 0]; batch mean 0,
    # sum sq .75, var .75/5 = .15, std .3872983 -> .25/.3873 = .6454972, -.75/.3873 = -1.9364917
    out = reinforce_pp(R_BASIC, G_BASIC, baseline=True)
    assert_close(out, t([0.6454972, -1.9364917, 0.6454972, 0.6454972, 0.0, 0.0]))
    with pytest.raises(ValueError, match="group_ids"):
        reinforce_pp(R_BASIC, baseline=True)


def test_reinforce_pp_degenerate_batches():
    assert_close(reinforce_pp(t([3.0])), t([0.0]))
    assert reinforce_pp(t([])).shape == (0,)


def test_integer_rewards_are_promoted():
    out = dr_grpo(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert out.dtype == torch.float32
    assert_close(out, t([0.5, -0.5]))


def test_compute_advantages_dispatch():
    assert_close(compute_advantages("grpo", R_BASIC, G_BASIC), t([0.5, -1.5, 0.5, 0.5, 0.0, 0.0]))
    assert_close(compute_advantages("rloo", R_MIXED, G_MIXED), t([1.5, -2.0, -1.5, 2.0, 0.0, 0.0]))
    # kwargs are forwarded
    out = compute_advantages("reinforce_pp", R_BASIC, G_BASIC, baseline=True)
    assert_close(out[1], torch.tensor(-1.9364917))
    assert set(adv_mod._ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)


def test_compute_advantages_unknown_name():
    with pytest.raises(ValueError) as err:
        compute_advantages("ppo", R_BASIC, G_BASIC)
    assert "'ppo'" in str(err.value)
    assert "dr_grpo, grpo, none, reinforce_pp, rloo" in str(err.value)


def test_advantage_input_validation():
    with pytest.raises(ValueError, match="must match"):
        grpo(R_BASIC, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        grpo(R_BASIC, G_BASIC.float())


# --------------------------------------------------------------------------- aggregate

# Ragged mask: row 0 has 3 tokens, row 1 has 2, row 2 is an all-padding row.
# Padded slots hold NaN / inf garbage that must not leak.
PER_TOKEN = t([[1.0, 2.0, 3.0, NAN], [5.0, 6.0, INF, 7.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def test_aggregate_token_mean():
    # (1 + 2 + 3 + 5 + 6) / 5 = 3.4
    assert_close(aggregate(PER_TOKEN, MASK, "token_mean"), torch.tensor(3.4))
    assert_close(aggregate(PER_TOKEN, MASK.bool()), torch.tensor(3.4))  # default mode, bool mask


def test_aggregate_seq_mean_token_mean():
    # row 0 mean 2, row 1 mean 5.5, row 2 empty (not counted) -> (2 + 5.5) / 2 = 3.75
    assert_close(aggregate(PER_TOKEN, MASK.float(), "seq_mean_token_mean"), torch.tensor(3.75))


def test_aggregate_seq_mean_token_sum_norm():
    # row 0: 6 / 8 = .75, row 1: 11 / 8 = 1.375 -> (0.75 + 1.375) / 2 = 1.0625
    out = aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", max_len=8)
    assert_close(out, torch.tensor(1.0625))
    with pytest.raises(ValueError, match="max_len"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_empty_mask_is_zero(mode):
    out = aggregate(PER_TOKEN, torch.zeros(3, 4), mode, max_len=4)
    assert_close(out, torch.tensor(0.0))


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown 'seq_sum'; known: seq_mean_token_mean"):
        aggregate(PER_TOKEN, MASK, "seq_sum")


# --------------------------------------------------------------------------- PPO clip

# Five masked tokens, old log-probs -1 so logprobs = -1 + ln(ratio). Row 1 has a padded slot
# whose garbage (old -inf, new 0) would give ratio = inf if it were not masked before exp:
#   a: ratio .5, A = -1 -> unclipped -.5, clipped .8 * -1 = -.8  -> min -.8 : LOW clip active
#   b: ratio 1.5, A = 2 -> unclipped 3,  clipped 1.28 * 2 = 2.56 -> min 2.56: HIGH clip active
#   c: ratio 1.1, A = 1 -> 1.1 either way                        -> 1.1 : no clip
#   d: ratio 1.5, A = -1 -> unclipped -1.5, clipped -1.28        -> -1.5: no clip (A < 0)
#   e: ratio .5, A = 1  -> unclipped .5,  clipped .8             -> .5  : no clip (A > 0)
# per-token loss = -min: [.8, -2.56, -1.1], [1.5, -.5]; token_mean = -1.86 / 5 = -0.372
OLD = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -INF]])
NEW = [[-1.0 + LN_HALF, -1.0 + LN_1_5, -1.0 + LN_1_1], [-1.0 + LN_1_5, -1.0 + LN_HALF, 0.0]]
ADV = t([[-1.0, 2.0, 1.0], [-1.0, 1.0, 0.0]])
PPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_ppo_clip_loss_values_and_metrics():
    logprobs = t(NEW, requires_grad=True)
    loss, metrics = ppo_clip_loss(logprobs, OLD, ADV, PPO_MASK)
    assert_close(loss, torch.tensor(-0.372))
    assert set(metrics) >= {"clip_fraction", "ratio_mean", "approx_kl"}
    assert all(isinstance(v, float) for v in metrics.values())
    # tokens a (low) and b (high) are clipped: 2 of 5
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    assert metrics["clip_low_fraction"] == pytest.approx(0.2)
    assert metrics["clip_high_fraction"] == pytest.approx(0.2)
    # (.5 + 1.5 + 1.1 + 1.5 + .5) / 5 = 1.02
    assert metrics["ratio_mean"] == pytest.approx(1.02)
    # -(2 ln .5 + 2 ln 1.5 + ln 1.1) / 5 = 0.480054 / 5 = 0.0960108
    assert metrics["approx_kl"] == pytest.approx(0.0960108, abs=1e-6)


def test_ppo_clip_gradient_only_through_unclipped_tokens():
    logprobs = t(NEW, requires_grad=True)
    old = OLD.clone()
    loss, _ = ppo_clip_loss(logprobs, old, ADV, PPO_MASK)
    loss.backward()
    # d(-ratio*A/5)/d logp = -ratio*A/5 on unclipped tokens, 0 on clipped ones and padding:
    #   a, b clipped -> 0; c: -1.1/5 = -.22; d: 1.5/5 = .3; e: -.5/5 = -.1; pad 0 (not NaN)
    assert_close(logprobs.grad, t([[0.0, 0.0, -0.22], [0.3, -0.1, 0.0]]))
    assert not old.requires_grad and old.grad is None


def test_ppo_clip_symmetric_clip_changes_result():
    # with clip_high = 0.2, token b is clipped at 1.2: 1.2 * 2 = 2.4 instead of 2.56
    # sum = .8 - 2.4 - 1.1 + 1.5 - .5 = -1.7 -> -0.34
    loss, _ = ppo_clip_loss(t(NEW), OLD, ADV, PPO_MASK, clip_high=0.2)
    assert_close(loss, torch.tensor(-0.34))


def test_ppo_clip_is_weights_are_detached():
    # weights [[2, .5, 1], [1, 1, 0]]: [1.6, -1.28, -1.1, 1.5, -.5] -> .22 / 5 = 0.044
    weights = t([[2.0, 0.5, 1.0], [1.0, 1.0, 0.0]], requires_grad=True)
    logprobs = t(NEW, requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, OLD, ADV, PPO_MASK, is_weights=weights)
    assert_close(loss, torch.tensor(0.044))
    loss.backward()
    assert logprobs.grad is not None
    assert weights.grad is None


def test_ppo_clip_sequence_advantages_broadcast():
    # ratio 1 everywhere, A = [2, -1] per sequence, mask [[1, 1], [1, 0]]:
    # per-token loss [-2, -2], [1, pad] -> token_mean -3/3 = -1; seq mean (-2 + 1)/2 = -.5
    lp = t([[-0.5, -0.7], [-0.2, -0.9]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = ppo_clip_loss(lp, lp, t([2.0, -1.0]), mask)
    assert_close(loss, torch.tensor(-1.0))
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    loss, _ = ppo_clip_loss(lp, lp, t([2.0, -1.0]), mask, agg="seq_mean_token_mean")
    assert_close(loss, torch.tensor(-0.5))
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(lp, lp, t([2.0, -1.0, 0.0]), mask)


# --------------------------------------------------------------------------- IS weights


def test_truncated_is_weights():
    # log-diffs [ln .5, ln 1.5, ln 3, 100 (overflows exp in fp32)], last slot padded
    target = t([[LN_HALF, LN_1_5, LN_3, 100.0, 5.0]], requires_grad=True)
    behaviour = torch.zeros(1, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w = truncated_is_weights(target, behaviour, mask, cap=2.0)
    assert_close(w, t([[0.5, 1.5, 2.0, 2.0, 0.0]]))
    assert not w.requires_grad
    w = truncated_is_weights(target[:, :3], behaviour[:, :3], mask[:, :3], cap=None)
    assert_close(w, t([[0.5, 1.5, 3.0]]))


# --------------------------------------------------------------------------- KL


def test_kl_estimators():
    # d = logp - ref = [.5, -1, 0] (+ a padded slot)
    logp = t([[0.5, -1.0, -2.0, 3.0]])
    ref = t([[0.0, 0.0, -2.0, -INF]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert_close(kl_penalty(logp, ref, mask, "k1"), t([[0.5, -1.0, 0.0, 0.0]]))
    # .5 d^2
    assert_close(kl_penalty(logp, ref, mask, "k2"), t([[0.125, 0.5, 0.0, 0.0]]))
    # exp(-d) + d - 1: exp(-.5) - .5 = .1065307; e - 2 = .7182818; 0
    assert_close(kl_penalty(logp, ref, mask, "k3"), t([[0.1065307, 0.7182818, 0.0, 0.0]]))
    assert_close(kl_penalty(logp, ref, mask), t([[0.1065307, 0.7182818, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown 'k4'; known: k1, k2, k3"):
        kl_penalty(logp, ref, mask, "k4")


# --------------------------------------------------------------------------- policy_loss

# One row, two tokens, A = 1, current logprobs 0:
#   proximal = [-ln 1.1, 0]            -> ratio vs proximal [1.1, 1] (no clip)
#   behaviour = proximal - [ln 1.5, ln 3] -> weight exp(prox - behav) = [1.5, 3 -> capped 2]
#   ratio vs behaviour would be [1.65, 3] (both clipped at 1.28)
CUR = [[0.0, 0.0]]
PROX = t([[-LN_1_1, 0.0]])
BEHAV = t([[-LN_1_1 - LN_1_5, -LN_3]])
ONE_ADV = t([1.0])
ONE_MASK = torch.ones(1, 2)


def test_policy_loss_decoupled_uses_proximal_ratio():
    cfg = AlgorithmConfig(off_policy="decoupled", is_cap=2.0)
    logprobs = t(CUR, requires_grad=True)
    loss, m = policy_loss(cfg, logprobs, BEHAV, ONE_ADV, ONE_MASK, proximal_logprobs=PROX)
    # per token: -1.1 * 1.5 = -1.65; -1 * 2 = -2 -> mean -1.825
    assert_close(loss, torch.tensor(-1.825))
    assert m["ratio_mean"] == pytest.approx(1.05)  # (1.1 + 1) / 2: proximal, not behaviour
    assert m["clip_fraction"] == 0.0
    assert m["is_weight_mean"] == pytest.approx(1.75)  # (1.5 + 2) / 2
    assert m["is_capped_fraction"] == pytest.approx(0.5)
    assert m["pg_loss"] == pytest.approx(-1.825)
    assert m["loss"] == pytest.approx(-1.825)
    loss.backward()
    # -ratio * A * w / 2: -1.1 * 1.5 / 2 = -.825; -1 * 2 / 2 = -1
    assert_close(logprobs.grad, t([[-0.825, -1.0]]))


def test_policy_loss_decoupled_uncapped():
    cfg = AlgorithmConfig(off_policy="decoupled", is_cap=None)
    loss, m = policy_loss(cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK, proximal_logprobs=PROX)
    # weights [1.5, 3]: (-1.65 - 3) / 2 = -2.325
    assert_close(loss, torch.tensor(-2.325))
    assert "is_capped_fraction" not in m


def test_policy_loss_tis_uses_old_logprobs():
    cfg = AlgorithmConfig(off_policy="tis", is_cap=2.0)
    # same numbers as decoupled with old = proximal; a proximal passed here is ignored
    loss, m = policy_loss(
        cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK, old_logprobs=PROX, proximal_logprobs=BEHAV
    )
    assert_close(loss, torch.tensor(-1.825))
    assert m["is_weight_mean"] == pytest.approx(1.75)


def test_policy_loss_none_uses_behaviour():
    # ratio vs behaviour [1.65, 3] with A = 1: both clipped at 1.28 -> loss -1.28
    cfg = AlgorithmConfig(off_policy="none")
    loss, m = policy_loss(cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK, old_logprobs=PROX)
    assert_close(loss, torch.tensor(-1.28))
    assert m["clip_fraction"] == pytest.approx(1.0)
    assert m["clip_high_fraction"] == pytest.approx(1.0)
    assert "is_weight_mean" not in m


def test_policy_loss_kl_term_and_gradients():
    # ratio 1 (logprobs == behaviour), A = 1 -> pg = -1
    # ref so that d = logp - ref = [.5, -1]: k3 = [.1065307, .7182818], mean .4124062
    # loss = -1 + .1 * .4124062 = -0.9587594
    cfg = AlgorithmConfig(kl_coef=0.1)
    logprobs = t([[-1.0, -2.0]], requires_grad=True)
    behaviour = t([[-1.0, -2.0]], requires_grad=True)
    ref = t([[-1.5, -1.0]], requires_grad=True)
    loss, m = policy_loss(cfg, logprobs, behaviour, ONE_ADV, ONE_MASK, ref_logprobs=ref)
    assert_close(loss, torch.tensor(-0.9587594))
    assert m["kl"] == pytest.approx(0.4124062, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(-1.0)
    loss.backward()
    # pg: -ratio * A / 2 = -.5 each; kl: .1 * (1 - exp(-d)) / 2 =
    #   .05 * (1 - .6065307) = .0196735 ; .05 * (1 - 2.7182818) = -.0859141
    assert_close(logprobs.grad, t([[-0.4803265, -0.5859141]]))
    assert behaviour.grad is None and ref.grad is None


def test_policy_loss_kl_k1_with_sum_norm_aggregation():
    # k1 = [.5, -1], mask row of 2 tokens, max_len 4: pg = -(1 + 1) / 4 = -.5,
    # kl = (.5 - 1) / 4 = -.125 -> loss = -.5 + .2 * -.125 = -0.525
    cfg = AlgorithmConfig(kl_coef=0.2, kl_estimator="k1", loss_agg="seq_mean_token_sum_norm")
    lp = t([[-1.0, -2.0]])
    loss, _ = policy_loss(cfg, lp, lp, ONE_ADV, ONE_MASK, ref_logprobs=t([[-1.5, -1.0]]), max_len=4)
    assert_close(loss, torch.tensor(-0.525))
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(cfg, lp, lp, ONE_ADV, ONE_MASK, ref_logprobs=t([[-1.5, -1.0]]))


def test_policy_loss_accepts_omegaconf_node():
    cfg = OmegaConf.structured(AlgorithmConfig(off_policy="decoupled"))
    loss, _ = policy_loss(cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK, proximal_logprobs=PROX)
    assert_close(loss, torch.tensor(-1.825))


@pytest.mark.parametrize(
    ("overrides", "kwargs", "missing", "why"),
    [
        ({"off_policy": "tis"}, {}, "old_logprobs", "tis"),
        ({"off_policy": "decoupled"}, {"old_logprobs": PROX}, "proximal_logprobs", "decoupled"),
        ({"kl_coef": 0.1}, {}, "ref_logprobs", "kl_coef"),
    ],
)
def test_policy_loss_missing_inputs(overrides, kwargs, missing, why):
    cfg = AlgorithmConfig(**overrides)
    with pytest.raises(ValueError) as err:
        policy_loss(cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK, **kwargs)
    assert missing in str(err.value)
    assert why in str(err.value)


def test_policy_loss_unknown_correction():
    cfg = AlgorithmConfig(off_policy="foo")
    with pytest.raises(ValueError, match=r"algorithm\.off_policy: unknown 'foo'"):
        policy_loss(cfg, t(CUR), BEHAV, ONE_ADV, ONE_MASK)


# --------------------------------------------------------------------------- config


def test_config_defaults_valid_and_structured():
    cfg = AlgorithmConfig()
    validate_algorithm(cfg)
    assert (cfg.advantage, cfg.off_policy, cfg.loss_agg, cfg.kl_estimator) == (
        "grpo",
        "none",
        "token_mean",
        "k3",
    )
    assert (cfg.clip_low, cfg.clip_high, cfg.is_cap, cfg.kl_coef) == (0.2, 0.28, 2.0, 0.0)
    node = OmegaConf.structured(AlgorithmConfig)
    node.is_cap = None
    node.off_policy = "decoupled"
    validate_algorithm(node)
    assert OFF_POLICY_CORRECTIONS == ("none", "tis", "decoupled")
    assert KL_ESTIMATORS == ("k1", "k2", "k3")


def test_validate_unknown_names_message():
    with pytest.raises(ValueError) as err:
        validate_algorithm(AlgorithmConfig(off_policy="foo"))
    assert str(err.value) == "algorithm.off_policy: unknown 'foo'; known: decoupled, none, tis"
    with pytest.raises(ValueError, match=r"algorithm\.advantage: unknown 'ppo'; known: dr_grpo"):
        validate_algorithm(AlgorithmConfig(advantage="ppo"))
    with pytest.raises(ValueError, match=r"algorithm\.loss_agg: unknown 'sum'"):
        validate_algorithm(AlgorithmConfig(loss_agg="sum"))
    with pytest.raises(ValueError, match=r"algorithm\.kl_estimator: unknown 'k9'"):
        validate_algorithm(AlgorithmConfig(kl_estimator="k9"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_low", -0.1),
        ("clip_low", 1.0),
        ("clip_high", -0.2),
        ("kl_coef", -1e-3),
        ("is_cap", -2.0),
        ("is_cap", 0.0),
        ("adv_eps", -1.0),
    ],
)
def test_validate_rejects_bad_numbers(field, value):
    with pytest.raises(ValueError) as err:
        validate_algorithm(AlgorithmConfig(**{field: value}))
    assert f"algorithm.{field}" in str(err.value)
    assert repr(value) in str(err.value)


def test_validate_uncapped_tis_rejected():
    with pytest.raises(ValueError, match=r"algorithm\.is_cap.*tis"):
        validate_algorithm(AlgorithmConfig(off_policy="tis", is_cap=None))


def test_constants_are_exported_names():
    assert math.isclose(AlgorithmConfig().adv_eps, 1e-6)
    assert LOSS_AGGREGATIONS == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "none"}


def test_logprob_agreement_counts_only_the_marked_rows_masked_tokens():
    """The trainer-vs-rollout gap an engine reports: masked tokens of marked rows only,
    accumulated over calls into [max, sum, tokens] without leaving the tensors' device."""
    from laminar_core import add_logprob_agreement

    lp = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    beh = t([[-1.5, -2.0, -9.0], [-4.0, -4.0, -4.0]])  # row 1 is far off but not marked
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # column 2 of row 0 is padding
    acc = torch.zeros(3, dtype=torch.float64)
    add_logprob_agreement(acc, lp, beh, mask, [True, False])
    assert acc.tolist() == pytest.approx([0.5, 0.5, 2.0])
    add_logprob_agreement(acc, lp, beh, mask, [False, False])  # nothing marked: unchanged
    add_logprob_agreement(acc, lp, beh, mask, [False, True])
    assert acc.tolist() == pytest.approx([3.0, 9.5, 5.0])


def test_a_trajectory_generated_only_by_a_version():
    """The rows an engine's log-prob gap counts: every token from the version it holds."""
    from laminar_core import Trajectory

    assert Trajectory("a", "g", 3).generated_only_by(3)  # no versions list: one version
    assert Trajectory("a", "g", 3, versions=[3]).generated_only_by(3)
    assert not Trajectory("a", "g", 3).generated_only_by(4)
    assert not Trajectory("a", "g", 3, versions=[3, 4]).generated_only_by(3)  # resumed on 4
