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
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import weakref
from pathlib import Path

import numpy as np

from kvpool import limits
from kvpool.errors import InvalidParams, SegmentNotFound, map_exceptions

log = logging.getLogger(__name__)

_MAGIC = b"KVPOOLSG"
_VERSION = 1
_HEADER = struct.Struct("<8sII Q 16s Q")  # magic, version, header size, capacity, token, pid
SHM_DIR_DEFAULT = "/dev/shm"
SEGMENT_FILE_PREFIX = "kvpool-"
SEGMENT_FILE_SUFFIX = ".seg"

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
        # hugetlbfs reports its huge page size here and refuses a file size that is not a
        # multiple of it (ftruncate: EINVAL); tmpfs reports the base page size.
        block_size = max(filesystem.f_bsize, limits.PAGE_SIZE_BYTES)
        file_size = limits.SEGMENT_HEADER_SIZE_BYTES + capacity_bytes
        file_size -= file_size % block_size
        capacity_bytes = file_size - limits.SEGMENT_HEADER_SIZE_BYTES
        if capacity_bytes < limits.SEGMENT_SIZE_BYTES_MIN:
            raise InvalidParams(
                f"segment size rounds down to {max(capacity_bytes, 0)} bytes in {directory} "
                f"(pages of {block_size} bytes): ask for more"
            )
        free_bytes = filesystem.f_bavail * filesystem.f_frsize
        if file_size > free_bytes:  # the common case, said plainly before any write (_reserve)
            raise InvalidParams(
                f"a segment of {file_size} bytes does not fit in {directory} ({free_bytes} bytes "
                "free): ask for less, or give that filesystem more room"
            )
        assert capacity_bytes % limits.PAGE_SIZE_BYTES == 0, capacity_bytes
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
        magic, version, header_size, capacity_bytes, file_token, _pid = _HEADER.unpack_from(file_map, 0)
        problem = ""
        if magic != _MAGIC or version != _VERSION or header_size != limits.SEGMENT_HEADER_SIZE_BYTES:
            problem = "not a kvpool segment"
        elif file_token != token:
            problem = "token mismatch (another segment took this path)"
        elif header_size + capacity_bytes > file_size:
            problem = "truncated"
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
    """Unlink segment files whose owner process is gone (a node killed with SIGKILL).

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
                path.unlink()  # while holding the lock: the file is gone before anyone else looks
            removed.append(path)
            log.info("removed stale segment file %s (its owner died)", path)
        except OSError:
            continue
    return removed
