"""A DRAM segment: a file in /dev/shm (or hugetlbfs), mapped and pre-faulted, with a header.

The node creates the segment; a same-host client maps the same file to copy bytes with one
memcpy (DESIGN.md §3). Mapping proves sameness by the random token in the header, never by IP.
This module is the file format and the mapping, not the allocator (the master owns allocation)
nor the transfer server.

    0        8         12            16              24        40           4096
    +--------+---------+-------------+---------------+---------+-----~~-----+----------------+
    | magic  | version | header_size | capacity_bytes| token   | owner pid  | data area ...  |
    +--------+---------+-------------+---------------+---------+-----~~-----+----------------+

Offsets that the master hands out are offsets into the data area. The file is created with
mode 0600 (exclusive create), so only processes of the same user can map it.

A node stopped with `--keep-ms` leaves its file in place (`Segment.keep`), with a record
beside it (`kvpool-<name>.kept`: the segment id, the inventory and a deadline), for the node
started again with the same name to take (`Segment.adopt`): an upgrade or a restart keeps the
node's DRAM objects. The file's pages, its token and the mappings of same-host clients stay as
they were; every kept object's checksum is verified before it is served again. Until the
deadline the stale-file sweep leaves a kept file alone; after it, the file and its record go.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
import time
import weakref
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from kvpool import limits
from kvpool.checksums import checksums_of
from kvpool.config import exact_size
from kvpool.errors import InvalidParams, SegmentNotFound, map_exceptions
from kvpool.protocol.messages import InventoryEntry

log = logging.getLogger(__name__)

_MAGIC = b"KVPOOLSG"
_VERSION = 1
_HEADER = struct.Struct("<8sII Q 16s Q")  # magic, version, header size, capacity, token, pid
SHM_DIR_DEFAULT = "/dev/shm"
SEGMENT_FILE_PREFIX = "kvpool-"
SEGMENT_FILE_SUFFIX = ".seg"
KEPT_FILE_SUFFIX = ".kept"
# A sweep that holds a kept file's lock for a moment (remove_stale_segments) delays its adoption.
_ADOPT_LOCK_TRIES = 500
_ADOPT_LOCK_WAIT_S = 0.01
# Kept objects are verified in slices of this many bytes, and the progress said at this
# interval: a segment of tens of GiB takes its node seconds to check at start.
_VERIFY_SLICE_BYTES = 1 << 30
_VERIFY_PROGRESS_LOG_INTERVAL_S = 10.0


# What a node stopped with --keep-ms leaves beside its segment file: this header, then the
# segment id and the inventory (msgpack), read by `adopt` only (a sweep reads the header: a
# record of millions of entries is a hundred MB). The deadline is on the wall clock: the
# restarted process shares no other clock with the one that stopped. The file's identity
# (device, inode, token) makes a record name no file made after it: an inode number is soon
# reused, and the token is drawn anew for each file.
_KEPT_MAGIC = b"KVPOOLKP"
_KEPT_VERSION = 1
_KEPT_HEADER = struct.Struct("<8sI Q Q Q 16s")  # magic, version, until_ms, device, inode, token
_NO_RECORD = "no record of a stop with --keep-ms beside it"
_kept_body = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(tuple[str, list[InventoryEntry]]))


class _KeptRecord(NamedTuple):
    until_ms: int
    device: int
    inode: int
    token: bytes

assert _HEADER.size <= limits.SEGMENT_HEADER_SIZE_BYTES
assert limits.SEGMENT_TOKEN_SIZE_BYTES == 16


class Segment:
    """A mapped segment file: `data` is a writable memoryview of exactly `capacity_bytes`.

    The owner (`create`) unlinks the file on `close`; a mapper (`open_mapped`) only unmaps.
    The owner holds an exclusive flock on the file from its creation until it is unlinked:
    that alone tells another node whether the file is stale (remove_stale_segments). The pid
    in the header means nothing across PID namespaces (containers sharing /dev/shm): there it
    may name no process while its owner lives, or a live one (PID 1) when its owner is dead.
    """

    def __init__(
        self, path: Path, file_map: mmap.mmap, capacity_bytes: int, token: bytes, is_owner: bool,
        lock_fd: int | None = None, file_id: tuple[int, int] | None = None,
    ):  # fmt: skip
        self.path = path
        self._file_id = file_id  # (device, inode) of the file mapped: is_unlinked
        self._lock_fd = lock_fd
        self.capacity_bytes = capacity_bytes
        self.token = token
        self.is_owner = is_owner
        self._map = file_map
        start = limits.SEGMENT_HEADER_SIZE_BYTES
        self.data = memoryview(file_map)[start : start + capacity_bytes]

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "mapped"
        return f"<Segment {self.path} {self.capacity_bytes} bytes {role}>"

    @classmethod
    def create(cls, directory: str, name: str, capacity_bytes: int, token: bytes) -> Segment:
        """Create, map and pre-fault a new segment file `directory/kvpool-<name>.seg`.

        Raises:
            InvalidParams: a capacity out of bounds, or the directory cannot hold the file.
        """
        if not limits.SEGMENT_SIZE_BYTES_MIN <= capacity_bytes <= limits.SEGMENT_SIZE_BYTES_MAX:
            raise InvalidParams(
                f"segment size {capacity_bytes} out of [{limits.SEGMENT_SIZE_BYTES_MIN}, "
                f"{limits.SEGMENT_SIZE_BYTES_MAX}]"
            )
        assert len(token) == limits.SEGMENT_TOKEN_SIZE_BYTES, len(token)
        path = Path(directory) / f"{SEGMENT_FILE_PREFIX}{name}{SEGMENT_FILE_SUFFIX}"
        try:
            filesystem = os.statvfs(directory)
        except OSError as exc:
            raise InvalidParams(f"cannot make segments in {directory}: {exc.strerror or exc}") from exc
        if not os.path.isdir(directory):  # statvfs takes a file too; the open below said only ENOTDIR
            raise InvalidParams(f"cannot make segments in {directory}: not a directory")
        file_size = _file_size(filesystem, capacity_bytes)
        capacity_bytes = file_size - limits.SEGMENT_HEADER_SIZE_BYTES
        if capacity_bytes < limits.SEGMENT_SIZE_BYTES_MIN:
            raise InvalidParams(
                f"segment size rounds down to {max(capacity_bytes, 0)} bytes in {directory} "
                f"(pages of {_block_size(filesystem)} bytes): ask for more"
            )
        free_bytes = filesystem.f_bavail * filesystem.f_frsize
        if file_size > free_bytes:  # the common case, said plainly before any write (_reserve)
            raise InvalidParams(
                f"a segment of {file_size} bytes does not fit in {directory} ({free_bytes} bytes "
                "free): ask for less, or give that filesystem more room"
            )
        assert capacity_bytes % limits.PAGE_SIZE_BYTES == 0, capacity_bytes
        if path.exists():  # said plainly: O_EXCL's "File exists" named no cause
            raise InvalidParams(f"{path} is in use: another node with the id {name!r} runs on this host")
        with map_exceptions({OSError: InvalidParams}):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            lock_fd = None
            try:
                # The lock on an open file of its own: the mapping holds the first one (and a
                # forked child inherits the mapping), so only this one can be let go of.
                lock_fd = os.open(path, os.O_RDONLY)
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # just created: no one holds it
                os.ftruncate(fd, file_size)
                _reserve(fd, file_size, directory)
                file_map = mmap.mmap(fd, file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                if lock_fd is not None:
                    os.close(lock_fd)
                path.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
        _HEADER.pack_into(
            file_map, 0, _MAGIC, _VERSION, limits.SEGMENT_HEADER_SIZE_BYTES, capacity_bytes,
            token, os.getpid(),
        )  # fmt: skip
        segment = cls(path, file_map, capacity_bytes, token, is_owner=True, lock_fd=lock_fd)
        try:
            segment._prefault()
        except BaseException:
            segment.close()
            raise
        _owned.add(segment)
        return segment

    @classmethod
    def adopt(
        cls, directory: str, name: str, capacity_bytes: int
    ) -> tuple[Segment, str, list[InventoryEntry], int] | None:
        """Take the segment file `directory/kvpool-<name>.seg` that a node stopped with
        --keep-ms left (`keep`), with the segment id, inventory and deadline it recorded. The
        entries are as recorded: `verified` tells which still hold their bytes. The record
        stays until `kept_taken`: a node killed while it verifies takes the file again at its
        next start.

        Returns None when there is none to take; a kept file that cannot be (its deadline
        passed, its record missing or unreadable) is removed, and the log says why.

        Raises:
            InvalidParams: the file is held by a running node (another with this name), or
                another capacity is asked for (the file and its record stay).
        """
        path = Path(directory) / f"{SEGMENT_FILE_PREFIX}{name}{SEGMENT_FILE_SUFFIX}"
        kept = _kept_path(path)
        if not path.exists():
            kept.unlink(missing_ok=True)  # its segment file was removed by hand
            return None
        with map_exceptions({OSError: InvalidParams}):
            fd = os.open(path, os.O_RDWR)
            lock_fd = None
            try:
                lock_fd = os.open(path, os.O_RDONLY)
                _lock_within_a_sweep(lock_fd, path, name)
                # Under the lock: the node that keeps the file writes its record before it lets go.
                for left in kept.parent.glob(f"{kept.name}.*.tmp"):  # a record a kill cut short
                    left.unlink(missing_ok=True)
                header = os.pread(fd, _HEADER.size, 0)
                problem, record = _kept_problem(lock_fd, header, kept)
                segment_id, entries = "", []
                if record is not None:
                    try:
                        segment_id, entries = _kept_body[1].decode(kept.read_bytes()[_KEPT_HEADER.size :])
                    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                        problem = f"its record {kept} is unreadable ({exc})"
                if not problem:
                    problem = _header_problem(header, os.fstat(fd).st_size)
                if not problem:
                    kept_capacity = _HEADER.unpack(header)[3]
                    asked = _file_size(os.statvfs(directory), capacity_bytes) - limits.SEGMENT_HEADER_SIZE_BYTES
                    if kept_capacity != asked:
                        # Refused, not removed: a mistyped size would lose every object kept for
                        # this restart, and cannot be undone (walk-through helper-155).
                        raise InvalidParams(
                            f"the segment kept for this node's restart ({path}, {len(entries)} objects) holds "
                            f"{exact_size(kept_capacity)}, memory_bytes asks for {exact_size(asked)}: start with "
                            f"the kept size to serve its objects again, or remove {path} and {kept} to start "
                            "without them"
                        )
                if problem == _NO_RECORD:  # a node of this name killed: nothing was kept
                    log.info("removed the segment file %s a node of this name left (%s)", path, problem)
                elif problem:
                    log.warning("segment file %s left by a stop with --keep-ms not taken: %s; removed", path, problem)
                if problem:
                    path.unlink(missing_ok=True)  # under the lock, as remove_stale_segments does
                    kept.unlink(missing_ok=True)
                    os.close(lock_fd)
                    return None
                assert record is not None
                file_size = os.fstat(fd).st_size
                flags = mmap.MAP_SHARED  # populated: its pages are in memory already, their tables are not
                if file_size <= limits.SHM_POPULATE_SIZE_BYTES_MAX:
                    flags |= mmap.MAP_POPULATE
                file_map = mmap.mmap(fd, file_size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                if lock_fd is not None:
                    os.close(lock_fd)
                raise
            finally:
                os.close(fd)
        _magic, _version, _size, kept_capacity, token, _pid = _HEADER.unpack_from(file_map, 0)
        _HEADER.pack_into(
            file_map, 0, _MAGIC, _VERSION, limits.SEGMENT_HEADER_SIZE_BYTES, kept_capacity, token, os.getpid()
        )
        segment = cls(path, file_map, kept_capacity, token, is_owner=True, lock_fd=lock_fd)
        _owned.add(segment)
        return segment, segment_id, entries, record.until_ms

    def kept_taken(self) -> None:
        """Remove the record of an adopted segment, once its objects are verified: from then on
        its bytes may change, and a node that dies leaves a stale file."""
        _kept_path(self.path).unlink(missing_ok=True)

    def keep(self, segment_id: str, entries: list[InventoryEntry], until_ms: int) -> None:
        """Close, leaving the file for `adopt` (a node started again with the same name) until
        `until_ms` by the wall clock. The owner's alone; no byte may change after (the node's
        transfer server is closed, and no copy into the segment runs: Node._copies_into_dram_ended).
        The record is written before the lock is let go of: a sweep finds the file locked, or
        kept."""
        assert self.is_owner and self._lock_fd is not None, self
        stat = os.fstat(self._lock_fd)
        header = _KEPT_HEADER.pack(_KEPT_MAGIC, _KEPT_VERSION, until_ms, stat.st_dev, stat.st_ino, self.token)
        kept = _kept_path(self.path)
        temporary = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        with map_exceptions({OSError: InvalidParams}):
            try:
                with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
                    file.write(header)
                    file.write(_kept_body[0].encode((segment_id, entries)))
                os.replace(temporary, kept)
            except BaseException:
                temporary.unlink(missing_ok=True)
                self.close()  # not kept: as a plain stop leaves it
                raise
        self.is_owner = False  # close unmaps and lets go of the lock, and unlinks nothing
        self.close()

    def verified(self, entries: list[InventoryEntry], what: str) -> tuple[list[InventoryEntry], int]:
        """The entries whose bytes in the segment match their checksum, and how many did not
        (or lay outside it). Logs its progress over a large segment, as `what`."""
        inside = [e for e in entries if 0 <= e.offset and e.size > 0 and e.offset + e.size <= self.capacity_bytes]
        good: list[InventoryEntry] = []
        checked_bytes = 0
        total_bytes = sum(e.size for e in inside)
        said_s = time.monotonic()
        start = 0
        while start < len(inside):
            end, slice_bytes = start, 0
            while end < len(inside) and (end == start or slice_bytes + inside[end].size <= _VERIFY_SLICE_BYTES):
                slice_bytes += inside[end].size
                end += 1
            batch = inside[start:end]
            sums = checksums_of([[self.data[e.offset : e.offset + e.size]] for e in batch])
            good.extend(e for e, checksum in zip(batch, sums) if checksum == e.checksum)
            checked_bytes += slice_bytes
            start = end
            if time.monotonic() - said_s >= _VERIFY_PROGRESS_LOG_INTERVAL_S:
                said_s = time.monotonic()
                log.info("%s: %d of %d bytes verified", what, checked_bytes, total_bytes)
        return good, len(entries) - len(good)

    @classmethod
    def open_mapped(cls, path: str, token: bytes) -> Segment:
        """Map an existing segment file and prove it is the one advertised.

        Raises:
            SegmentNotFound: the file is absent, unreadable, malformed or has another token.
        """
        with map_exceptions({OSError: SegmentNotFound, ValueError: SegmentNotFound}):
            fd = os.open(path, os.O_RDWR)
            try:
                stat = os.fstat(fd)
                file_size = stat.st_size
                if file_size < limits.SEGMENT_HEADER_SIZE_BYTES:
                    raise SegmentNotFound(f"{path} is too small to be a segment")
                # Fill the page tables now (one pass, kernel side) rather than with a fault per
                # 4 KiB page on the first copies: measured 9.3 ms vs 1.9 ms for a first 16 MiB.
                flags = mmap.MAP_SHARED
                if file_size <= limits.SHM_POPULATE_SIZE_BYTES_MAX:
                    flags |= mmap.MAP_POPULATE
                file_map = mmap.mmap(fd, file_size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        problem = _header_problem(file_map[: _HEADER.size], file_size)
        _magic, _version, _header_size, capacity_bytes, file_token, _pid = _HEADER.unpack_from(file_map, 0)
        if not problem and file_token != token:
            problem = "token mismatch (another segment took this path)"
        if problem:
            file_map.close()
            raise SegmentNotFound(f"{path}: {problem}")
        return cls(Path(path), file_map, capacity_bytes, token, is_owner=False, file_id=(stat.st_dev, stat.st_ino))

    def is_unlinked(self) -> bool:
        """Whether a mapped segment's file is gone from its path (its node stopped; the memory
        stays while this process maps it). False for the owner's."""
        if self._file_id is None:
            return False
        try:
            stat = os.stat(self.path)
        except OSError:
            return True
        return (stat.st_dev, stat.st_ino) != self._file_id

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Views handed out must be released first."""
        try:
            self.data.release()
            self._map.close()
        except BufferError:
            # A transfer still holds a view (e.g. a send in flight at shutdown): the mapping
            # goes when the process does. The file is unlinked regardless.
            pass
        if self.is_owner:
            self.path.unlink(missing_ok=True)
        self._let_go_of_lock()

    def _let_go_of_lock(self) -> None:
        """Close this process's descriptor of the owner's lock (the lock goes with the last)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _prefault(self) -> None:
        # Touch every page once now, so that the first puts do not pay page faults (tmpfs
        # allocates on first write). One store per page, done by numpy at memory speed.
        pages = np.frombuffer(self.data, dtype=np.uint8)[:: limits.PAGE_SIZE_BYTES]
        pages[:] = 0
        del pages


# statfs(2) f_type of the filesystems whose files live in memory alone (linux/magic.h: tmpfs,
# hugetlbfs, ramfs): a segment elsewhere is written back to a disk.
MEMORY_FILESYSTEM_MAGICS = frozenset({0x01021994, 0x958458F6, 0x858458F6})
_libc = ctypes.CDLL(None, use_errno=True)  # statfs(2): os has statvfs only, which has no type


def filesystem_magic(directory: str) -> int | None:
    """statfs(2)'s f_type of the filesystem `directory` is on (what `stat -f -c %t` prints),
    or None when it cannot be read. The kernel's answer for the directory itself: a mount
    table read by path is wrong under a bind mount over a parent (review helper-156)."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on x86-64 and arm64
    if _libc.statfs(os.fsencode(directory), buffer) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF  # f_type, the first field


def _block_size(filesystem: os.statvfs_result) -> int:
    # hugetlbfs reports its huge page size here and refuses a file size that is not a
    # multiple of it (ftruncate: EINVAL); tmpfs reports the base page size.
    return max(filesystem.f_bsize, limits.PAGE_SIZE_BYTES)


def _file_size(filesystem: os.statvfs_result, capacity_bytes: int) -> int:
    """The size of the file of a segment of `capacity_bytes` there (rounded down to its pages)."""
    file_size = limits.SEGMENT_HEADER_SIZE_BYTES + capacity_bytes
    return file_size - file_size % _block_size(filesystem)


def _header_problem(header: bytes, file_size: int) -> str:
    """What is wrong with a segment file's header, or ""."""
    if len(header) < _HEADER.size:
        return "not a kvpool segment"
    magic, version, header_size, capacity_bytes, _token, _pid = _HEADER.unpack_from(header, 0)
    if magic != _MAGIC or version != _VERSION or header_size != limits.SEGMENT_HEADER_SIZE_BYTES:
        return "not a kvpool segment"
    if header_size + capacity_bytes > file_size:
        return "truncated"
    return ""


def _kept_path(path: Path) -> Path:
    """Where a kept segment's record is: beside its file, or in /dev/shm for a file on
    hugetlbfs (which takes no write(2): files there are only mapped)."""
    name = path.name.removesuffix(SEGMENT_FILE_SUFFIX) + KEPT_FILE_SUFFIX
    try:
        is_huge = os.statvfs(path.parent).f_bsize > limits.PAGE_SIZE_BYTES
    except OSError:
        is_huge = False
    return (Path(SHM_DIR_DEFAULT) if is_huge else path.parent) / name


def _kept_problem(lock_fd: int, header: bytes, kept: Path) -> tuple[str, _KeptRecord | None]:
    """Why the segment file locked by `lock_fd`, which begins with `header`, is not kept for a
    restart, or "" and its record's header (at `kept`: its first bytes only are read)."""
    try:
        with open(kept, "rb") as file:
            raw = file.read(_KEPT_HEADER.size)
    except FileNotFoundError:
        return _NO_RECORD, None
    except OSError as exc:
        return f"its record {kept} is unreadable ({exc})", None
    if len(raw) < _KEPT_HEADER.size or raw[: len(_KEPT_MAGIC)] != _KEPT_MAGIC:
        return f"its record {kept} is unreadable (not a record)", None
    _magic, version, until_ms, device, inode, token = _KEPT_HEADER.unpack(raw)
    if version != _KEPT_VERSION:
        return f"its record is of version {version}, not {_KEPT_VERSION}", None
    stat = os.fstat(lock_fd)
    segment_token = _HEADER.unpack_from(header, 0)[4] if len(header) >= _HEADER.size else b""
    if (device, inode, token) != (stat.st_dev, stat.st_ino, segment_token):
        return "its record names another file", None
    if until_ms <= time.time() * 1000:
        return "kept until a moment past", None
    return "", _KeptRecord(until_ms, device, inode, token)


def _lock_within_a_sweep(lock_fd: int, path: Path, name: str) -> None:
    """Take the owner's lock on a kept file: a sweep (remove_stale_segments) may hold it for a
    moment; a running node holds it for good.

    Raises:
        InvalidParams: a running node holds it.
    """
    for _ in range(_ADOPT_LOCK_TRIES):
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(_ADOPT_LOCK_WAIT_S)
    raise InvalidParams(f"{path} is in use: another node with the id {name!r} runs on this host")


def _reserve(fd: int, file_size: int, directory: str) -> None:
    """Allocate the whole file now (tmpfs, hugetlbfs): the room checked before may have gone
    to another process since, and a store into a page the filesystem cannot give kills the
    process with SIGBUS; fallocate says ENOSPC instead. A filesystem without fallocate is
    left to the pre-faulting, as before.

    Raises:
        InvalidParams: the filesystem has no room for the file.
    """
    try:
        os.posix_fallocate(fd, 0, file_size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise InvalidParams(
                f"a segment of {file_size} bytes does not fit in {directory} (taken by another "
                "process meanwhile?): ask for less, or give that filesystem more room"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


# Segments this process owns: a forked child closes its copies of their lock descriptors, so
# that the lock is its owner's alone (a worker forked by an embedded node's process would keep
# a dead owner's file from ever being found stale).
_owned: weakref.WeakSet[Segment] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    for segment in list(_owned):
        segment._let_go_of_lock()
    _owned.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def remove_stale_segments(directory: str = SHM_DIR_DEFAULT) -> list[Path]:
    """Unlink segment files whose owner process is gone (a node killed with SIGKILL), but for
    those kept for a restart until a deadline not yet past (`Segment.keep`).

    Only files of this user that no process holds the flock of are removed: the owner holds
    it from `create` until the file is unlinked, and the kernel lets go of it when the owner
    dies, whatever its pid. The header's pid is not looked at: a node that ran as PID 1 in a
    container sharing /dev/shm left a pid that is alive in the next container (itself
    restarted), and the restarted node could never create its segment (EEXIST).
    """
    removed = []
    for path in Path(directory).glob(f"{SEGMENT_FILE_PREFIX}*{SEGMENT_FILE_SUFFIX}"):
        try:
            with open(path, "rb") as file:
                header = file.read(_HEADER.size)
                if len(header) < _HEADER.size or header[: len(_MAGIC)] != _MAGIC:
                    continue
                try:
                    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its owner lives, here or in another PID namespace
                # The path may name a new file by now (its node restarted: the old one unlinked,
                # a new one created and locked): unlink only the file this lock is on.
                locked, named = os.fstat(file.fileno()), os.stat(path)
                if (locked.st_dev, locked.st_ino) != (named.st_dev, named.st_ino):
                    continue
                kept = _kept_path(path)
                if not _kept_problem(file.fileno(), header, kept)[0]:
                    continue  # its node is restarting
                path.unlink()  # while holding the lock: the file is gone before anyone else looks
                kept.unlink(missing_ok=True)
            removed.append(path)
            log.info("removed stale segment file %s (its owner died)", path)
        except OSError:
            continue
    return removed
