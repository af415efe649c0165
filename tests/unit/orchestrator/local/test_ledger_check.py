"""The exactly-once audit (``orchestrator.ledger_check.audit``) that the orchestrator
recomputes from a checkpoint's ledger ranges ``[step, first_sample, count]``."""

import pytest

from orchestrator.local.ledger_check import audit


def test_a_clean_lineage_has_no_duplicates_and_nothing_missing():
    one_range_per_step = [[step, (step - 1) * 16, 16] for step in range(1, 11)]
    assert audit(one_range_per_step, 160) == {
        "expected": 160,
        "consumed": 160,
        "duplicates": 0,
        "missing": 0,
    }
    two_ranges_per_step = [[1, 0, 8], [1, 8, 8], [2, 16, 8], [2, 24, 8]]
    assert audit(two_ranges_per_step, 32) == {
        "expected": 32,
        "consumed": 32,
        "duplicates": 0,
        "missing": 0,
    }


def test_a_replayed_step_is_counted_as_duplicates():
    # A generation that re-ran step 6 without the lineage forgetting the first run.
    ranges = [[step, (step - 1) * 16, 16] for step in range(1, 7)] + [[6, 80, 16], [7, 96, 16]]
    assert audit(ranges, 112) == {"expected": 112, "consumed": 128, "duplicates": 16, "missing": 0}


def test_a_skipped_step_is_counted_as_missing():
    ranges = [[1, 0, 16], [2, 32, 16]]
    assert audit(ranges, 48) == {"expected": 48, "consumed": 32, "duplicates": 0, "missing": 16}


def test_replayed_and_skipped_samples_are_counted():
    # Step 2 was replayed after a restart (samples 16-31 twice) and step 3 skipped
    # samples 32-39.
    ranges = [[1, 0, 16], [2, 16, 16], [2, 16, 16], [3, 40, 8]]
    assert audit(ranges, 48) == {"expected": 48, "consumed": 56, "duplicates": 16, "missing": 8}


def test_duplicates_count_every_read_after_the_first():
    # Samples 4 and 5 read twice, 6 and 7 three times: 2·1 + 2·2 repeated reads.
    ranges = [[1, 0, 8], [2, 4, 4], [3, 6, 2]]
    assert audit(ranges, 8) == {"expected": 8, "consumed": 14, "duplicates": 6, "missing": 0}


def test_overlaps_of_three_and_ranges_beyond_the_expected_end():
    ranges = [[1, 0, 10], [2, 5, 10], [3, 8, 4], [4, 20, 5]]
    # depth: 0-5:1, 5-8:2, 8-10:3, 10-12:2, 12-15:1, 20-25:1 (beyond 16)
    assert audit(ranges, 16) == {
        "expected": 16,
        "consumed": 29,
        "duplicates": 3 + 2 * 2 + 2,
        "missing": 1,
    }


def test_samples_beyond_the_expected_count_are_consumed_but_not_missing():
    assert audit([[1, 0, 16], [2, 16, 16]], 16) == {
        "expected": 16,
        "consumed": 32,
        "duplicates": 0,
        "missing": 0,
    }
    assert audit([[1, 16, 16]], 16) == {
        "expected": 16,
        "consumed": 16,
        "duplicates": 0,
        "missing": 16,
    }


def test_nothing_consumed():
    assert audit([], 0) == {"expected": 0, "consumed": 0, "duplicates": 0, "missing": 0}
    assert audit([], 5) == {"expected": 5, "consumed": 0, "duplicates": 0, "missing": 5}


@pytest.mark.parametrize("count", [1, 10**12])
def test_audit_cost_does_not_depend_on_range_sizes(count):
    # A sweep over range ends, not a set of sample indices: 10**12 samples are as cheap as 1.
    assert audit([[1, 0, count], [2, count, count]], 2 * count)["missing"] == 0
