"""A deterministic synthetic token stream with learnable structure, addressed by global
sample index so that a resumed job, on any world size, replays no sample and skips none.

The tokens follow a fixed random sparse Markov chain: every token has exactly two
possible successors, chosen by the data seed. Sample ``i`` starts at a random token and
walks the chain with fair coin flips, both drawn from a generator seeded by
``(seed, i)`` only. A model that learns the chain reaches a loss of ln 2 ≈ 0.69 nats;
an untrained one starts near ln(vocab).
"""

from __future__ import annotations

import torch

SUCCESSORS_PER_TOKEN = 2
_MASK64 = (1 << 64) - 1
# Separate key spaces for the chain and the samples, so that no sample index can
# reproduce the chain's generator.
_CHAIN_KEY = 1
_SAMPLE_KEY = 2


def _mix64(value: int) -> int:
    """splitmix64's finaliser: neighbouring inputs give unrelated 64-bit outputs, so the
    generators of samples i and i+1 share no visible structure."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _generator(*key: int) -> torch.Generator:
    seed = 0
    for part in key:
        seed = _mix64(seed ^ part)
    # torch.Generator takes seeds below 2**63 without surprises across versions.
    return torch.Generator().manual_seed(seed >> 1)


def rank_samples(position: int, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The samples data-parallel rank ``dp_rank`` of ``dp_size`` takes when the job is at
    global data position ``position`` (samples consumed so far), as ``(first global
    sample index, count)``: samples ``[position + r·B/D, position + (r+1)·B/D)``."""
    if global_batch % dp_size != 0:
        raise ValueError(
            f"global batch {global_batch} does not divide by the {dp_size} data-parallel ranks; "
            f"use a multiple of {dp_size}, "
            f"e.g. --global-batch {max(dp_size, global_batch - global_batch % dp_size)}"
        )
    per_rank = global_batch // dp_size
    return position + dp_rank * per_rank, per_rank


class SyntheticTokens:
    """Samples of ``seq_len`` + 1 tokens over ``vocab`` token ids, a pure function of
    ``(seed, global sample index)``."""

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        if vocab < SUCCESSORS_PER_TOKEN:
            raise ValueError(
                f"vocab {vocab} is too small for a chain with {SUCCESSORS_PER_TOKEN} "
                "successors per token; "
                f"use at least {SUCCESSORS_PER_TOKEN}"
            )
        if seq_len < 1:
            raise ValueError(f"seq_len {seq_len} must be at least 1")
        self.vocab = vocab
        self.seq_len = seq_len
        self.seed = seed
        # Distinct successors per token: the top-2 of a random row is a uniform draw
        # of two different tokens.
        scores = torch.rand(vocab, vocab, generator=_generator(seed, _CHAIN_KEY))
        self.successors = scores.topk(SUCCESSORS_PER_TOKEN, dim=1).indices

    def batch(self, start_index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``start_index`` … ``start_index + count - 1`` as ``(inputs, targets)``,
        both int64 of shape ``[count, seq_len]``; ``targets`` is ``inputs`` shifted left
        by one token."""
        tokens = torch.empty(count, self.seq_len + 1, dtype=torch.long)
        choices = torch.empty(count, self.seq_len, dtype=torch.long)
        for row in range(count):
            generator = _generator(self.seed, _SAMPLE_KEY, start_index + row)
            tokens[row, 0] = torch.randint(self.vocab, (), generator=generator)
            choices[row] = torch.randint(SUCCESSORS_PER_TOKEN, (self.seq_len,), generator=generator)
        for position in range(self.seq_len):
            tokens[:, position + 1] = self.successors[tokens[:, position], choices[:, position]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
