"""Epochs, as tables: a stamp of a later epoch wins whatever its number; generations of
an epoch are numbered above every one of the epochs before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.epoch import (
    GENERATIONS_PER_EPOCH,
    Stamp,
    advanced,
    current,
    first_generation,
    newest,
    next_generation,
)


@pytest.mark.parametrize(
    "offered, highest, ok",
    [
        (Stamp(0, 7), Stamp(0, 7), True),  # the same leader
        (Stamp(0, 9), Stamp(0, 7), True),  # a later leader
        (Stamp(0, 5), Stamp(0, 7), False),  # a superseded one
        (Stamp(1, 5), Stamp(0, 7), True),  # after a restore: lower term, later epoch
        (Stamp(1, 5), Stamp(1, 7), False),  # superseded within the later epoch
        (Stamp(0, 900), Stamp(1, 5), False),  # a leader of before the restore
        (Stamp(2, 1), Stamp(1, 10**12), True),
    ],
)
def test_a_later_epoch_wins_even_with_a_lower_number(offered, highest, ok):
    assert current(offered, highest) is ok
    assert newest(highest, offered) == (offered if ok else highest)


@pytest.mark.parametrize(
    "generation, epoch, following",
    [
        (0, 0, 1),  # a new job
        (7, 0, 8),
        (7, 1, GENERATIONS_PER_EPOCH + 1),  # restored: the epoch's first
        (GENERATIONS_PER_EPOCH + 1, 1, GENERATIONS_PER_EPOCH + 2),
        (GENERATIONS_PER_EPOCH + 3, 2, 2 * GENERATIONS_PER_EPOCH + 1),
        (0, 3, 3 * GENERATIONS_PER_EPOCH + 1),  # a job submitted after a restore
    ],
)
def test_generations_are_numbered_from_the_epochs_first(generation, epoch, following):
    assert next_generation(generation, epoch) == following


@given(
    st.integers(0, 50),
    st.integers(0, GENERATIONS_PER_EPOCH - 1),
    st.integers(1, 5),
    st.integers(0, GENERATIONS_PER_EPOCH - 1),
)
def test_plain_generation_order_is_the_order_of_epoch_and_generation(
    epoch, within, later, within_later
):
    """Every generation a later epoch gives is above every one an earlier epoch gave
    (fewer than GENERATIONS_PER_EPOCH of them each): comparing the bare numbers, as
    fences do, is comparing (epoch, generation)."""
    before = first_generation(epoch) + within
    after = first_generation(epoch + later) + within_later
    assert after > before
    assert next_generation(before, epoch + later) == first_generation(epoch + later)


@pytest.mark.parametrize(
    "previous, asked, epoch",
    [(0, None, 1), (4, None, 5), (0, 7, 7), (4, 5, 5)],
)
def test_a_restore_moves_to_the_next_epoch_or_the_one_asked_for(previous, asked, epoch):
    assert advanced(previous, asked) == epoch


@pytest.mark.parametrize("previous, asked", [(0, 0), (4, 4), (4, 2)])
def test_an_epoch_asked_for_that_does_not_grow_is_refused(previous, asked):
    with pytest.raises(ValueError, match=f"holds epoch {previous} already; give a higher"):
        advanced(previous, asked)
