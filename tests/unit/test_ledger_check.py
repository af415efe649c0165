from orchestrator.ledger_check import audit


def test_a_clean_lineage_has_no_duplicates_and_nothing_missing():
    ranges = [[1, 0, 8], [1, 8, 8], [2, 16, 8], [2, 24, 8]]
    assert audit(ranges, 32) == {"expected": 32, "consumed": 32, "duplicates": 0,
                                 "missing": 0}


def test_replayed_and_skipped_samples_are_counted():
    # Step 2 was replayed after a restart (samples 16-31 twice) and step 3 skipped
    # samples 32-39.
    ranges = [[1, 0, 16], [2, 16, 16], [2, 16, 16], [3, 40, 8]]
    assert audit(ranges, 48) == {"expected": 48, "consumed": 56, "duplicates": 16,
                                 "missing": 8}


def test_overlaps_of_three_and_ranges_beyond_the_expected_end():
    ranges = [[1, 0, 10], [2, 5, 10], [3, 8, 4], [4, 20, 5]]
    # depth: 0-5:1, 5-8:2, 8-10:3, 10-12:2, 12-15:1, 20-25:1 (beyond 16)
    assert audit(ranges, 16) == {"expected": 16, "consumed": 29,
                                 "duplicates": 3 + 2 * 2 + 2, "missing": 1}
