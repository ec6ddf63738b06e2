"""Micro-batch layouts: packed rows hold only real tokens, positions restart per trajectory,
labels never cross a trajectory, and both layouts point at the same response tokens."""

from __future__ import annotations

import torch
from fsdp_batches import long_tail_batch

from laminar_fsdp.batching import (
    collate,
    collate_packed,
    empty_micro_batch,
    pack_bins,
    padded,
    response_mask,
    responses,
    trainable,
)

PAD = 0


def _trajs():
    return trainable(long_tail_batch(50, groups=2, samples=3, response=(1, 9)).trajectories)


def test_pack_bins_fill_to_the_budget_in_real_tokens():
    lengths = [9, 3, 7, 2, 12, 5]
    bins = pack_bins(lengths, list(range(6)), 12)
    assert sorted(i for b in bins for i in b) == list(range(6))  # each index exactly once
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert len(bins) == 4  # 38 tokens: first-fit decreasing needs ceil(38/12) = 4
    assert pack_bins([20, 3], [0, 1], 8) == [[0], [1]]  # too long: a bin of its own
    assert pack_bins(lengths, [5, 1, 3], 100) == [[1, 3, 5]]


def test_packed_row_restarts_positions_and_keeps_labels_inside_trajectories():
    trajs = _trajs()
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
    trajs = _trajs()
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
