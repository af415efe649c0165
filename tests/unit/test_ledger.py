"""The data ledger: recording what each step consumed, its ledger.json form, and the
exactly-once summary the orchestrator recomputes from that file."""

import json

import pytest

from orchestrator.ledger_check import audit as summarize
from trainer.ledger import LEDGER_FILE, Ledger, merge


def test_merge_joins_touching_ranges_of_one_step_and_drops_empty_ones():
    # Four data-parallel ranks in rank order, then the same in another order, plus the
    # zero counts that tensor/pipeline peers send.
    assert merge(3, [(32, 4), (36, 4), (40, 4), (44, 4)]) == [[3, 32, 16]]
    assert merge(3, [(40, 4), (0, 0), (32, 4), (44, 4), (36, 4), (0, 0)]) == [[3, 32, 16]]
    assert merge(1, [(0, 8), (16, 8)]) == [[1, 0, 8], [1, 16, 8]]
    assert merge(1, [(0, 0)]) == []


def test_merge_keeps_overlaps_visible():
    # Two ranks that read the same samples: the duplicate must survive the merge.
    assert merge(2, [(16, 8), (16, 8)]) == [[2, 16, 8], [2, 16, 8]]
    assert summarize(merge(2, [(16, 8), (16, 8)]), 32)["duplicates"] == 8


def test_ledger_records_steps_and_writes_the_documented_json(tmp_path):
    ledger = Ledger()
    for step in (1, 2):
        position = (step - 1) * 8
        ledger.record(step, [(position, 4), (position + 4, 4)])
    path = ledger.write(str(tmp_path), global_batch=8, step=2)
    assert path == str(tmp_path / LEDGER_FILE)
    assert json.loads((tmp_path / LEDGER_FILE).read_text()) == {
        "global_batch": 8, "step": 2, "ranges": [[1, 0, 8], [2, 8, 8]],
    }
    # What a checkpoint stores comes back as the same ledger.
    assert Ledger(ledger.ranges).document(8, 2) == ledger.document(8, 2)


def test_exactly_once():
    ranges = [[step, (step - 1) * 16, 16] for step in range(1, 11)]
    assert summarize(ranges, 160) == {"expected": 160, "consumed": 160, "duplicates": 0, "missing": 0}


def test_a_replayed_step_is_counted_as_duplicates():
    # A generation that re-ran step 6 without the lineage forgetting the first run.
    ranges = [[step, (step - 1) * 16, 16] for step in range(1, 7)] + [[6, 80, 16], [7, 96, 16]]
    assert summarize(ranges, 112) == {"expected": 112, "consumed": 128, "duplicates": 16, "missing": 0}


def test_a_skipped_step_is_counted_as_missing():
    ranges = [[1, 0, 16], [2, 32, 16]]
    assert summarize(ranges, 48) == {"expected": 48, "consumed": 32, "duplicates": 0, "missing": 16}


def test_duplicates_count_every_read_after_the_first():
    # Samples 4 and 5 read twice, 6 and 7 three times: 2·1 + 2·2 repeated reads.
    ranges = [[1, 0, 8], [2, 4, 4], [3, 6, 2]]
    summary = summarize(ranges, 8)
    assert summary == {"expected": 8, "consumed": 14, "duplicates": 6, "missing": 0}
    assert summary["consumed"] == summary["expected"] - summary["missing"] + summary["duplicates"]


def test_samples_beyond_the_expected_count_are_consumed_but_not_missing():
    assert summarize([[1, 0, 16], [2, 16, 16]], 16) == {"expected": 16, "consumed": 32, "duplicates": 0, "missing": 0}
    assert summarize([[1, 16, 16]], 16) == {"expected": 16, "consumed": 16, "duplicates": 0, "missing": 16}


def test_nothing_consumed():
    assert summarize([], 0) == {"expected": 0, "consumed": 0, "duplicates": 0, "missing": 0}
    assert summarize([], 5) == {"expected": 5, "consumed": 0, "duplicates": 0, "missing": 5}


@pytest.mark.parametrize("count", [1, 10**12])
def test_summary_cost_does_not_depend_on_range_sizes(count):
    # A sweep over range ends, not a set of sample indices: 10**12 samples are as cheap as 1.
    assert summarize([[1, 0, count], [2, count, count]], 2 * count)["missing"] == 0
