"""The registry of caller memory that zero-copy calls read from and write into."""

import numpy as np
import pytest

from kvpool.client.buffers import BufferRegistry
from kvpool.errors import InvalidParams


def test_lent_views_are_the_registered_bytes_and_hold_exactly_their_buffers():
    registry = BufferRegistry()
    first, second, idle = (np.arange(4096 * n, dtype=np.uint32).view(np.uint8) for n in (4, 2, 1))
    a, b, c = (registry.register(array) for array in (first, second, idle))
    addresses, sizes = [a, a + 4096, b + 100, a + 8192], [4096, 4096, 50, 0]
    with registry.lent(addresses, sizes) as views:
        assert [bytes(v) for (v,) in views] == [
            first[:4096].tobytes(), first[4096:8192].tobytes(), second[100:150].tobytes(), b""
        ]
        views[2][0][:] = b"\x07" * 50  # views write into the caller's memory
        for held in (a, b):
            with pytest.raises(InvalidParams, match="in use by 1 call"):
                registry.unregister(held)
        registry.unregister(c)  # a buffer the call does not use stays free to go
    assert set(second[100:150]) == {7}
    with registry.lent([[a, b], [a + 4096]], [[10, 20], [30]], per_key=True) as views:
        assert [[len(v) for v in parts] for parts in views] == [[10, 20], [30]]
    registry.unregister(a)  # every block returned: nothing held
    registry.unregister(b)


@pytest.mark.parametrize(
    "address_at, size, match",
    [
        (lambda a, b: a - 1, 10, "not in a registered buffer"),
        (lambda a, b: a + 4000, 200, "runs past"),  # past the end of the first buffer
        (lambda a, b: b + 8191, 2, "runs past"),  # past the end of the last one
        (lambda a, b: a, -1, "negative size"),
    ],
)
def test_a_range_outside_one_registered_buffer_is_refused_and_nothing_stays_held(address_at, size, match):
    registry = BufferRegistry()
    # Two buffers side by side in one array: a range across their seam lies in neither.
    memory = np.zeros(3 * 4096, dtype=np.uint8)
    a = registry.register(memory[:4096])
    b = registry.register(memory[4096:])
    good = [a, b]
    with pytest.raises(InvalidParams, match=match):
        with registry.lent([*good, address_at(a, b)], [8, 8, size]):
            pass
    registry.unregister(a)  # the refused call held nothing, not even its good ranges' buffers
    registry.unregister(b)


def test_a_key_without_ranges_or_with_sizes_for_other_ranges_is_refused():
    registry = BufferRegistry()
    a = registry.register(bytearray(4096))
    for addresses, sizes in (([[]], [[]]), ([[a, a + 8]], [[8]])):
        with pytest.raises(InvalidParams, match="as many sizes as buffers"):
            with registry.lent(addresses, sizes, per_key=True):
                pass
    registry.unregister(a)


@pytest.mark.parametrize(
    "addresses, sizes, per_key",
    [
        ([0, 2048], [4096, 4096], False),  # two keys' pages sharing 2 KiB
        ([4096, 2048], [4096, 4096], False),  # the same, out of address order
        ([100, 0, 4196], [1, 8192, 1], False),  # one inside a larger one
        ([[0, 1024]], [[2048, 2048]], True),  # one key's layer buffers
        ([[0, 6000], [4096]], [[100, 100], [4096]], True),  # one key's layer in another key's page
    ],
)
def test_ranges_a_get_writes_may_not_overlap_and_a_refused_call_holds_nothing(addresses, sizes, per_key):
    registry = BufferRegistry()
    base = registry.register(bytearray(3 * 4096))
    if per_key:
        addresses = [[base + a for a in key_addresses] for key_addresses in addresses]
    else:
        addresses = [base + a for a in addresses]
    with pytest.raises(InvalidParams, match="overlap"):
        with registry.lent(addresses, sizes, per_key=per_key, is_written=True):
            pass
    with registry.lent(addresses, sizes, per_key=per_key):  # a put only reads them: fine
        pass
    registry.unregister(base)


def test_ranges_a_get_writes_may_touch_come_in_any_order_or_be_empty():
    registry = BufferRegistry()
    base = registry.register(bytearray(3 * 4096))
    addresses, sizes = [base + 8192, base, base + 4096, base + 100, base + 4096], [4096, 4096, 4096, 0, 0]
    with registry.lent(addresses, sizes, is_written=True) as views:
        assert [len(v) for (v,) in views] == sizes
    with registry.lent([[base, base + 1024], [base + 2048]], [[1024, 1024], [2048]], per_key=True, is_written=True):
        pass
    registry.unregister(base)
