"""A short account of two values that differ where objects' bytes or long lists are involved,
for pytest's assertion messages (conftest.py's pytest_assertrepr_compare).

pytest's own diff pretty-prints every byte: one 64 KiB value is some 2,700 lines, and CI keeps
the last 12,000 characters of the run, so a failed `get_batch(keys) == values` showed only the
middle of one value's bytes, not which test failed nor which key missed. This says which
positions or keys differ and how (a miss, a length, the first byte that differs)."""

from __future__ import annotations

import numpy as np
import xxhash

LARGE_BYTES = 64  # shorter ones read well in pytest's own diff
# pytest diffs sequences with difflib, quadratic in their length: two lists of 16,384 error
# codes took over two minutes, and the test's timeout fired instead of its assertion.
LONG_SEQUENCE = 256
SHOWN_DIFFERENCES = 12

Bytes = (bytes, bytearray, memoryview)


def explain(left: object, right: object) -> list[str] | None:
    """Lines saying how `left == right` fails, or None for pytest's own diff (no large bytes,
    no long sequences)."""
    if _is_long_sequence(left) and _is_long_sequence(right):
        return _explain_items(left, right)
    if not (_holds_large_bytes(left) or _holds_large_bytes(right)):
        return None
    if isinstance(left, Bytes) and isinstance(right, Bytes):
        return [f"{_describe(left)} == {_describe(right)}", _first_difference(bytes(left), bytes(right))]
    if type(left) is type(right) and isinstance(left, (list, tuple, dict)):
        return _explain_items(left, right)
    return [f"{_describe(left)} == {_describe(right)}"]


def _is_long_sequence(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > LONG_SEQUENCE


def _holds_large_bytes(value: object) -> bool:
    if isinstance(value, Bytes):
        return len(value) > LARGE_BYTES
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(isinstance(item, Bytes) and len(item) > LARGE_BYTES for item in value)


def _describe(value: object) -> str:
    if isinstance(value, Bytes):
        data = bytes(value)
        return f"<{len(data)} bytes, xxh3 {xxhash.xxh3_64_hexdigest(data)}, {data[:8]!r}...>"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_difference(left: bytes, right: bytes) -> str:
    common = min(len(left), len(right))
    unequal = np.flatnonzero(np.frombuffer(left, np.uint8, common) != np.frombuffer(right, np.uint8, common))
    offset = int(unequal[0]) if len(unequal) else common
    if offset == common:
        return f"the shorter is a prefix of the longer ({len(left)} and {len(right)} bytes)"
    return f"first difference at byte {offset} of {len(left)} and {len(right)}"


def _explain_items(left, right) -> list[str]:
    if isinstance(left, dict) and isinstance(right, dict):
        positions, noun = list({**left, **right}), "key(s)"
    else:
        positions, noun = range(max(len(left), len(right))), "position(s)"
    differing = [p for p in positions if _differs(_item(left, p), _item(right, p))]
    lines = [f"{_describe(left)} == {_describe(right)}: {len(differing)} {noun} differ"]
    for p in differing[:SHOWN_DIFFERENCES]:
        lines.append(f"  [{p!r}] {_describe(_item(left, p))} != {_describe(_item(right, p))}")
    if len(differing) > SHOWN_DIFFERENCES:
        lines.append(f"  ... and {len(differing) - SHOWN_DIFFERENCES} more")
    return lines


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def _differs(mine: object, theirs: object) -> bool:
    try:
        return bool(mine != theirs)
    except (TypeError, ValueError):  # e.g. arrays, whose != is elementwise
        return mine is not theirs


def _item(container, position):
    if isinstance(container, dict):
        return container.get(position, ABSENT)
    return container[position] if position < len(container) else ABSENT
