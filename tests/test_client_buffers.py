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
        # After the last one, in no buffer: it said "runs past its registered buffer" (helper-157).
        (lambda a, b: b + 8192, 2, "not in a registered buffer"),
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


@pytest.mark.parametrize(
    "address_type, size_type",
    [
        (np.uint64, np.int64),  # numpy 2: their sum is a float64, which no slice takes
        (np.int64, np.uint64),
        (int, np.int32),  # an address plus an int32 overflowed
    ],
)
@pytest.mark.parametrize("per_key", [False, True])
def test_numpy_integer_addresses_and_sizes_are_taken_as_ints(address_type, size_type, per_key):
    """Engines keep their pages' addresses and sizes in numpy arrays; the registry takes them
    as the Python ints they stand for, and registers by a numpy address too."""
    registry = BufferRegistry()
    memory = np.arange(3 * 4096, dtype=np.uint16).view(np.uint8)
    base = registry.register(np.uint64(memory.ctypes.data), np.int64(memory.nbytes))
    assert base == memory.ctypes.data and type(base) is int
    offsets = [0, 4096, 9000]
    addresses = [address_type(base + offset) for offset in offsets]
    sizes = [size_type(n) for n in (4096, 4096, 100)]
    if per_key:
        addresses, sizes = [[a] for a in addresses], [[n] for n in sizes]
    else:
        addresses, sizes = np.array(addresses, dtype=address_type), np.array(sizes, dtype=size_type)
    with registry.lent(addresses, sizes, per_key=per_key, is_written=True) as views:
        assert [bytes(v) for (v,) in views] == [memory[o : o + n].tobytes() for o, n in zip(offsets, (4096, 4096, 100))]
    registry.unregister(np.uint64(base))
    assert len(registry) == 0


def test_an_empty_buffer_or_an_address_registered_already_is_refused_and_the_registry_stays_whole():
    """Two empty bytearrays share one address (CPython's): both registered made one view under
    two starts, and a lookup near it raised KeyError once one was unregistered."""
    registry = BufferRegistry()
    for empty in (bytearray(), np.zeros(0, dtype=np.uint8), bytearray(10)[10:]):
        with pytest.raises(InvalidParams, match="empty buffer"):
            registry.register(empty)
    memory = bytearray(8192)
    base = registry.register(memory)
    with pytest.raises(InvalidParams, match="already registered"):
        registry.register(base, 100)
    assert len(registry) == 1
    with registry.lent([base + 10], [10]) as views:
        assert len(views[0][0]) == 10
    registry.unregister(base)
    assert len(registry) == 0


def test_arguments_that_are_neither_integers_nor_buffers_are_invalid_params_naming_them():
    """A float, str or None address or size, a flat list where each key needs a sequence, a
    strided view or a str to register: TypeError (or ValueError) came out before. Each is
    InvalidParams naming the argument, and nothing is registered or held."""
    registry = BufferRegistry()
    base = registry.register(bytearray(8192))
    lent_refusals = [
        ([float(base)], [10], False, "each of addresses must be an integer, not float"),
        ([str(base)], [10], False, "each of addresses must be an integer, not str"),
        ([None], [10], False, "each of addresses must be an integer, not NoneType"),
        ([base], [10.0], False, "each of sizes must be an integer, not float"),
        ([base], 10, False, "sizes must be a sequence of integers, not int"),
        ([base], [10], True, "addresses must be a sequence of integers per key, not int"),  # flat lists
        ([[base]], [[10.0]], True, "each of sizes must be an integer, not float"),
    ]
    for addresses, sizes, per_key, match in lent_refusals:
        for is_written in (False, True):
            with pytest.raises(InvalidParams, match=match):
                with registry.lent(addresses, sizes, per_key=per_key, is_written=is_written):
                    pass
    register_refusals = [
        ((np.zeros((10, 10), dtype=np.uint8)[:, ::2],), "C-contiguous buffer, not ndarray"),
        (("abc",), "C-contiguous buffer, not str"),
        ((bytearray(100), 10.0), "size_bytes must be an integer, not float"),
        ((base + 9000, 10.5), "size_bytes must be an integer, not float"),
        ((2**64, 10), "positive address and size in 64 bits"),  # OverflowError from ctypes before
    ]
    for args, match in register_refusals:
        with pytest.raises(InvalidParams, match=match):
            registry.register(*args)
    with pytest.raises(InvalidParams, match="address must be an integer, not str"):
        registry.unregister("x")
    assert len(registry) == 1
    registry.unregister(base)  # nothing held
