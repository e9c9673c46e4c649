"""The assertion messages of comparisons of objects' bytes (tests/bytes_diff.py)."""

from tests.bytes_diff import explain


def test_a_batch_that_missed_names_the_positions_and_how():
    values = [bytes([i]) * 20_000 for i in range(5)]
    lines = explain(values[:3] + [None, values[4][:100]], values)
    assert lines[0] == "<list of 5> == <list of 5>: 2 position(s) differ"
    assert lines[1].startswith("  [3] None != <20000 bytes, xxh3 ")
    assert lines[2].startswith("  [4] <100 bytes, xxh3 ") and len(lines) == 3


def test_dicts_name_their_keys_and_bytes_their_first_difference():
    values = {"a": b"a" * 100, "b": b"b" * 100}
    lines = explain({"a": b"x" * 100}, values)
    assert lines[0].endswith("2 key(s) differ") and lines[2].startswith("  ['b'] (absent) != <100 bytes")
    assert explain(b"a" * 99 + b"z", b"a" * 100)[1] == "first difference at byte 99 of 100 and 100"
    assert explain(b"a" * 99, b"a" * 100)[1] == "the shorter is a prefix of the longer (99 and 100 bytes)"


def test_small_values_keep_pytests_own_diff():
    assert explain([b"short", None], [b"short", b"other"]) is None
    assert explain(1, 2) is None


def test_items_without_a_plain_answer_to_equality_count_as_differing():
    import numpy as np

    lines = explain([b"x" * 100, np.zeros(3)], [b"x" * 100, np.ones(3)])
    assert lines[0].endswith("1 position(s) differ") and lines[1].startswith("  [1] array(")


def test_long_lists_of_codes_name_the_positions_not_a_diff_of_every_item():
    """pytest's own diff of two lists of 16,384 codes ran for minutes (difflib is quadratic),
    and the test's timeout fired in place of its assertion."""
    codes = [0] * 16_384
    codes[7], codes[9_000] = -706, -704
    lines = explain(codes, [0] * 16_384)
    assert lines[0] == "<list of 16384> == <list of 16384>: 2 position(s) differ"
    assert lines[1:] == ["  [7] -706 != 0", "  [9000] -704 != 0"]
    assert explain([0] * 3, [1] * 3) is None
