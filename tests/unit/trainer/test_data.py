"""The synthetic token stream: a pure function of (seed, global sample index), split
across data-parallel ranks so that any world size sees the same global batch."""

import pytest
import torch

from trainer.data import SyntheticTokens, rank_samples


def test_sample_depends_only_on_seed_and_index():
    data = SyntheticTokens(vocab=64, seq_len=16, seed=3)
    inputs, targets = data.batch(10, 4)
    for row in range(4):
        alone_inputs, alone_targets = SyntheticTokens(vocab=64, seq_len=16, seed=3).batch(
            10 + row, 1
        )
        assert torch.equal(inputs[row], alone_inputs[0])
        assert torch.equal(targets[row], alone_targets[0])


def test_seeds_and_indices_give_different_samples():
    first, _ = SyntheticTokens(vocab=64, seq_len=16, seed=0).batch(0, 2)
    other_seed, _ = SyntheticTokens(vocab=64, seq_len=16, seed=1).batch(0, 2)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first, other_seed)


def test_targets_follow_the_two_successor_chain():
    data = SyntheticTokens(vocab=32, seq_len=24, seed=5)
    inputs, targets = data.batch(100, 8)
    assert inputs.shape == targets.shape == (8, 24)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    allowed = data.successors[inputs]  # [8, 24, 2]
    assert bool(((allowed == targets.unsqueeze(-1)).any(-1)).all())
    assert all(len(set(row.tolist())) == 2 for row in data.successors)


def test_both_successors_are_equally_likely():
    # Fair coin flips are what put the best achievable loss at ln 2.
    data = SyntheticTokens(vocab=16, seq_len=64, seed=0)
    inputs, targets = data.batch(0, 64)
    took_first = (targets == data.successors[inputs][..., 0]).float().mean().item()
    assert abs(took_first - 0.5) < 0.05


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_split_the_global_batch_whatever_the_world_size(dp_size):
    position, global_batch = 48, 16
    indices = []
    for rank in range(dp_size):
        first, count = rank_samples(position, global_batch, rank, dp_size)
        assert count == global_batch // dp_size
        indices.extend(range(first, first + count))
    assert indices == list(range(position, position + global_batch))


def test_rank_samples_rejects_an_indivisible_batch():
    with pytest.raises(ValueError, match="does not divide by the 3 data-parallel ranks"):
        rank_samples(0, 16, 0, 3)
