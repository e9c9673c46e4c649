"""Registered buffers: caller memory that zero-copy puts read from and gets write into.

Callers register memory once (`register_buffer`), by raw address and size as Mooncake's API
does, or by passing any writable buffer object (bytearray, numpy array, mmap). Zero-copy calls
then name a range by address; the registry turns it into a memoryview after checking that the
whole range lies inside one registered buffer, so a wrong address is an InvalidParams error,
never a write to arbitrary memory. It is not an allocator and does not own the memory.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvpool import limits
from kvpool.errors import BufferOverflow, InvalidParams
from kvpool.protocol.frames import buffer_address


def address_of(buffer: object) -> int:
    """The start address of a writable buffer object (bytearray, numpy array, mmap...)."""
    view = memoryview(buffer)  # type: ignore[arg-type]
    if view.readonly:
        raise InvalidParams("a registered buffer must be writable")
    return buffer_address(view)


def integer(value: object, name: str) -> int:
    """`value` as a Python int: any integer (`__index__`, numpy's too), not a float or a str.
    Raises InvalidParams naming `name`."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidParams(f"{name} must be an integer, not {type(value).__name__}: {value!r:.100}") from None


def _not_integers(addresses: Sequence, sizes: Sequence, per_key: bool) -> InvalidParams:
    """Why `lent` could not take `addresses` and `sizes` as integers (errors only)."""
    for name, values in (("addresses", addresses), ("sizes", sizes)):
        for key_values in values if per_key else [values]:
            try:
                items = list(key_values)
            except TypeError:  # a flat list given where each key needs a sequence, say
                return InvalidParams(
                    f"{name} must be a sequence of integers{' per key' if per_key else ''}, not "
                    f"{type(key_values).__name__}: {key_values!r:.100}"
                )
            for value in items:
                integer(value, f"each of {name}")
    return InvalidParams("addresses and sizes must be integers")


class BufferRegistry:
    """Registered ranges, sorted by start address; they never overlap. Thread-safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._views: dict[int, memoryview] = {}
        self._owners: dict[int, object] = {}  # keeps registered objects alive
        # How many calls in flight use each registered start: unregister refuses it meanwhile.
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._starts)

    def copy_after_fork(self) -> BufferRegistry:
        """The same ranges under a new lock, for a forked child: a buffer's address is the
        same there, and the lock a parent thread may have held at the fork stays held."""
        registry = BufferRegistry()
        registry._starts, registry._views, registry._owners = list(self._starts), dict(self._views), dict(self._owners)
        return registry  # no call of the parent's is in flight in the child

    def register(self, buffer: object | int, size_bytes: int | None = None) -> int:
        """Register `size_bytes` at address `buffer` (any integer: numpy's too), or a buffer
        object (its first `size_bytes`, or all of it). Returns its address.

        Raises:
            InvalidParams: not an address or a writable C-contiguous buffer, a size that is
                not an integer or not positive, an empty buffer, a range that overlaps a
                registered one, or too many buffers. Nothing is registered then.
        """
        if size_bytes is not None:
            size_bytes = integer(size_bytes, "size_bytes")
        try:  # an address: an int, or numpy's uint64 of one (an array is a buffer object)
            address = operator.index(buffer)  # type: ignore[call-overload]
        except TypeError:
            address = None
        if address is not None:
            if size_bytes is None or size_bytes <= 0 or address <= 0 or address + size_bytes > 2**64:
                raise InvalidParams("register_buffer(address, size_bytes) needs a positive address and size in 64 bits")
            view = memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")
            owner = None
        else:
            try:
                view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
            except TypeError as exc:
                raise InvalidParams(
                    f"register_buffer takes an address or a writable C-contiguous buffer, not "
                    f"{type(buffer).__name__} ({exc})"
                ) from None
            # Empty, it would lie at an address other buffers share (CPython's empty bytearrays
            # all do): two of them under one start corrupted the registry.
            if not len(view):
                raise InvalidParams("an empty buffer cannot be registered")
            address, owner = address_of(buffer), buffer
            if size_bytes is not None:
                if not 0 < size_bytes <= len(view):
                    raise InvalidParams(f"size_bytes {size_bytes} outside the buffer of {len(view)}")
                view = view[:size_bytes]
        with self._lock:
            if len(self._starts) >= limits.REGISTERED_BUFFERS_MAX:
                raise InvalidParams(f"more than {limits.REGISTERED_BUFFERS_MAX} registered buffers")
            if address in self._views:
                raise InvalidParams(f"a buffer is already registered at 0x{address:x}")
            index = bisect.bisect_right(self._starts, address)
            if index and self._starts[index - 1] + len(self._views[self._starts[index - 1]]) > address:
                raise InvalidParams(f"buffer at 0x{address:x} overlaps a registered buffer")
            if index < len(self._starts) and address + len(view) > self._starts[index]:
                raise InvalidParams(f"buffer at 0x{address:x} overlaps a registered buffer")
            self._starts.insert(index, address)
            self._views[address] = view
            if owner is not None:
                self._owners[address] = owner
        return address

    def unregister(self, address: int) -> None:
        """Raises InvalidParams if nothing is registered at `address`."""
        address = integer(address, "address")
        with self._lock:
            if address not in self._views:
                raise InvalidParams(f"no buffer registered at 0x{address:x}")
            if self._held.get(address):
                raise InvalidParams(
                    f"buffer at 0x{address:x} is in use by {self._held[address]} call(s) in flight "
                    "(or a disk read of a cancelled one, still writing): unregister it once they ended"
                )
            del self._views[address]
            self._starts.remove(address)
            self._owners.pop(address, None)

    @contextlib.contextmanager
    def lent(
        self, addresses: Sequence[int] | Sequence[Sequence[int]], sizes: Sequence[int] | Sequence[Sequence[int]],
        *, per_key: bool = False, is_written: bool = False,
    ) -> Iterator[list[list[memoryview]]]:
        """Views of ranges inside registered buffers for one call, one list per key: one range
        per key, or with `per_key` a sequence of ranges per key (e.g. one per layer). Within the
        block the buffers they lie in are in use: unregister refuses them, so that a caller
        cannot free memory a transfer of this call still reads or writes (a raw registration
        freed mid-transfer crashed the process). One lock for the whole batch.

        `is_written`: the call writes the ranges (a get), so no two may overlap: copies and
        replies land in any order, and a get whose ranges overlapped reported success with
        another key's bytes in them. A put only reads them: overlap is fine there.

        Raises:
            InvalidParams: an address or size that is not an integer, a range not inside one
                registered buffer, a key without ranges, or (`is_written`) two ranges that
                overlap. Nothing is held then.
        """
        # Python ints from here on: engines keep addresses and sizes in numpy arrays, whose
        # arithmetic is not Python's (numpy 2: a uint64 address plus an int64 size is a float64,
        # which no slice takes; an int32 size plus an address overflows). One pass in C each
        # (~2 us for 128 ranges), over every key's ranges at once.
        try:
            if per_key:
                counts = list(map(len, addresses))
                if counts != list(map(len, sizes)) or 0 in counts:
                    raise InvalidParams("each key needs as many sizes as buffers, and at least one")
                starts = list(map(operator.index, itertools.chain.from_iterable(addresses)))
                lengths = list(map(operator.index, itertools.chain.from_iterable(sizes)))
            else:
                starts, lengths = list(map(operator.index, addresses)), list(map(operator.index, sizes))
        except TypeError:
            raise _not_integers(addresses, sizes, per_key) from None
        used: set[int] = set()
        with self._lock:
            flat = self._views_locked(starts, lengths, used)
            if is_written:
                check_disjoint(starts, lengths)
            for start in used:
                self._held[start] = self._held.get(start, 0) + 1
        if per_key:
            views, at = [], 0
            for count in counts:
                views.append(flat[at : at + count])
                at += count
        else:
            views = [[view] for view in flat]
        try:
            yield views
        finally:
            self._release(used)

    def hold(self, views: Iterable[memoryview]) -> Callable[[], None]:
        """Hold the registered buffers that `views` (lent by `lent`, still held) lie in as a
        call in flight does, until the function returned is called (once): for writes that
        outlast their call (a cancelled get's disk read that would not end in time). Views of
        memory not registered (a plain get's own bytes) hold nothing."""
        ranges = [(buffer_address(view), len(view)) for view in views if len(view)]
        used: set[int] = set()
        with self._lock:
            for address, size_bytes in ranges:
                with contextlib.suppress(InvalidParams):  # not in a registered buffer
                    used.add(self._buffer_of(address, size_bytes)[0])
            for start in used:
                self._held[start] = self._held.get(start, 0) + 1
        return functools.partial(self._release, used)

    def _release(self, used: set[int]) -> None:
        with self._lock:
            for start in used:
                count = self._held.pop(start) - 1
                if count:
                    self._held[start] = count

    def _views_locked(self, addresses: Sequence[int], sizes: Sequence[int], used: set[int]) -> list[memoryview]:
        """Views of the ranges, adding the start of each buffer they lie in to `used`. A run of
        ranges in one buffer (a batch's pages) finds it once."""
        start, end, whole = 0, -1, None
        views = []
        for address, size_bytes in zip(addresses, sizes):
            if not (start <= address and address + size_bytes <= end and size_bytes >= 0):
                start, whole = self._buffer_of(address, size_bytes)
                end = start + len(whole)
                used.add(start)
            views.append(whole[address - start : address - start + size_bytes])  # type: ignore[index]
        return views

    def _buffer_of(self, address: int, size_bytes: int) -> tuple[int, memoryview]:
        """The start and whole view of the registered buffer that holds the range; the lock held."""
        if size_bytes < 0:
            raise InvalidParams(f"negative size {size_bytes}")
        index = bisect.bisect_right(self._starts, address) - 1
        if index >= 0:
            start = self._starts[index]
            whole = self._views[start]
            # Past the end of the buffer below it is in none (it said "runs past" that one).
            if not size_bytes or address - start < len(whole):
                if address - start + size_bytes > len(whole):
                    raise InvalidParams(f"range 0x{address:x}+{size_bytes} runs past its registered buffer")
                return start, whole
        raise InvalidParams(f"address 0x{address:x} is not in a registered buffer (register_buffer it first)")

    def view(self, address: int, size_bytes: int) -> memoryview:
        """A memoryview of a range inside a registered buffer (held by a `lent` block of the
        caller's: a call's span over ranges it was lent).

        Raises:
            InvalidParams: the range is not inside one registered buffer.
        """
        with self._lock:
            start, whole = self._buffer_of(address, size_bytes)
        return whole[address - start : address - start + size_bytes]


def check_disjoint(addresses: Sequence[int], sizes: Sequence[int]) -> None:
    """Raises InvalidParams if two of the ranges (address, size) overlap; empty ones overlap
    nothing. O(n) for ranges in address order (a batch's pages: ~6 us for 128 on this project's
    VM), else a sort (~19 us)."""
    end = 0
    for address, size_bytes in zip(addresses, sizes):
        if address < end:
            break  # out of order, or an overlap: sorted below
        if size_bytes:
            end = address + size_bytes
    else:
        return
    ranges = sorted((address, size_bytes) for address, size_bytes in zip(addresses, sizes) if size_bytes)
    for (first, first_size), (second, second_size) in zip(ranges, ranges[1:]):
        if first + first_size > second:
            raise InvalidParams(
                f"ranges 0x{first:x}+{first_size} and 0x{second:x}+{second_size} overlap: "
                "a get writes each of its ranges, so they must not share a byte"
            )


def check_fits(object_size_bytes: int, buffer_size_bytes: int) -> None:
    if object_size_bytes > buffer_size_bytes:
        raise BufferOverflow(
            f"object of {object_size_bytes} bytes does not fit a buffer of {buffer_size_bytes}"
        )
