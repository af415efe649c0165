"""The data ledger: recording what each step consumed and its ledger.json form. The
exactly-once audit the orchestrator recomputes from that file is tested in
test_ledger_check.py."""

import json

from orchestrator.local.ledger_check import audit as summarize
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
        "global_batch": 8,
        "step": 2,
        "ranges": [[1, 0, 8], [2, 8, 8]],
    }
    # The ranges read back from ledger.json make the same ledger.
    stored = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert Ledger(stored["ranges"]).document(8, 2) == ledger.document(8, 2)
