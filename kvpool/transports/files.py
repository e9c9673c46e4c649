"""Object files on a local or shared filesystem: the I/O of the disk and DFS tiers.

Everything kvpool does to the files of protocol/objectfile.py goes through here, and this is
where their OSErrors become typed errors (STYLE.md: OSError is mapped at the I/O boundary):
a missing file is ObjectNotFound, a file that is not the object asked for is ChecksumMismatch
or TransferFailed, any other failure is TransferFailed (InvalidParams for a directory that
cannot be used at all). It is not the disk tier (node/disk.py decides what to keep) and holds
no state beyond the open files it hands out.

Writes are atomic: the bytes go to `<name>.<random>.tmp` (a DFS file's also names its writer:
objectfile.temp_name), optionally fdatasync'ed, then the temporary file is renamed to `<name>`;
a crash at any moment leaves either the whole new file or none (plus a temporary file that
scans remove). The directory's own fsync, which makes the rename durable, is the caller's
(`sync_directory`, once per batch). A caller that may find between the two steps that the file
is no longer wanted writes it with `write_temporary` and renames it with `publish`
(node/moves.py). A written file is dropped from the page cache (POSIX_FADV_DONTNEED): DRAM is
the DRAM tier's, not the disk tier's.

Every call here blocks (disk or network filesystem): callers on an event loop run them in a
thread (node/moves.py, the Connection's file sender).

Sending a file to a socket (`send_some`: as much as the socket takes within a short wait, the
rest of the wait left to the caller) runs in a worker thread on a dup() of the socket: a uvloop
transport has no loop.sendfile, and a sendfile on the loop thread would block it on the disk.
Measured on this repository's VM (loopback, 256 MiB from the page cache, one thread):
os.sendfile 2.2 GB/s; os.preadv into a buffer then transport.write 0.7 GB/s.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import select
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvpool import limits
from kvpool.checksums import checksum_of, copy_bytes
from kvpool.errors import (
    ChecksumMismatch,
    FilesystemFull,
    InvalidParams,
    KVPoolError,
    ObjectNotFound,
    RpcFailed,
    TransferFailed,
    map_exceptions,
)
from kvpool.protocol import objectfile
from kvpool.protocol.frames import PAGE_BYTES, buffer_address, is_slow_copy
from kvpool.protocol.messages import FilesystemReport
from kvpool.protocol.objectfile import ObjectHeader, TierIdentity

# The first read of a header: the fixed part and a key up to ~4 KiB (one page).
_HEADER_READ_BYTES = objectfile.ALIGN_BYTES
# Bytes per copy_file_range / sendfile call between files.
_COPY_CHUNK_BYTES = 64 * limits.MIB
# How long send_some waits in its thread for room in a socket, at a time and in all, before it
# gives the thread back: a reader that reads makes room well within it (each hand-back to the
# event loop and new thread hop cost up to 12% of a 128 MiB sendfile over loopback, ad hoc), and
# one that stopped reading holds the thread no longer; the event loop judges the deadline.
SEND_ROOM_WAIT_MS = 20
SEND_CALL_MS_MAX = 200
# Reads into a buffer at a slow offset from the page cache's (read_range_into) from this size
# go through a bounce buffer of this size per reading thread. 64 x 4 MiB objects from the page
# cache into a numpy array, four threads: 3.9 GB/s straight, 6.7 through the bounce buffer,
# 10.3 straight into a page-aligned array (`bench_paths.py files`, warm_* figures).
BOUNCE_READ_BYTES_MIN = 64 * limits.KIB
BOUNCE_BUFFER_BYTES = 1 * limits.MIB
_bounce = threading.local()
log = logging.getLogger(__name__)

_READ_ERRORS: dict[type[BaseException], type] = {FileNotFoundError: ObjectNotFound, OSError: TransferFailed}
_WRITE_ERRORS: dict[type[BaseException], type] = {OSError: TransferFailed}
# What a write that found its filesystem full fails with (FilesystemFull, not TransferFailed:
# the master then caps that tier's room instead of trying it again and again).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What an open fails with when this process (EMFILE) or the system (ENFILE) has no file
# descriptor left: no fault of the file (is_out_of_descriptors).
_NO_DESCRIPTOR_ERRNOS = (errno.EMFILE, errno.ENFILE)


class FileRange(NamedTuple):
    """Payload bytes that lie in a file: `size` bytes at `offset` of the open file `fd`.
    Whoever is handed one owns the descriptor and closes it (the Connection, after sending,
    with close_parts). The ranges of one payload may share a descriptor (the pages of one
    object file): close_parts closes each descriptor once."""

    fd: int
    offset: int
    size: int


Part = bytes | bytearray | memoryview | FileRange


class PayloadTagOwed(NamedTuple):
    """In place of the tag that follows a sealed payload holding file ranges, until the thread
    that sends the frame reads them (payload_tag_of): the loop does not read files."""

    mac: Poly1305


# --- reading -------------------------------------------------------------------------------


def open_object(path: str | Path, key: str, size_bytes: int) -> tuple[int, ObjectHeader]:
    """Open an object file and check that it holds `key` with `size_bytes` bytes, all of them
    (a file cut short is found here, before any of it is read or sent).

    Returns:
        The open descriptor (the caller closes it) and the header.

    Raises:
        ObjectNotFound: no such file (dropped, or never there).
        ChecksumMismatch: the file holds another object, is no object file, or is cut short.
        TransferFailed: the file cannot be read.
    """
    with map_exceptions(_READ_ERRORS):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = _read_header_fd(fd)
        if header is None or header.key != key or header.size != size_bytes:
            raise ChecksumMismatch(f"{path} does not hold {key!r} of {size_bytes} bytes")
        with map_exceptions(_READ_ERRORS):
            file_size = os.fstat(fd).st_size
        if file_size < header.file_size:
            raise ChecksumMismatch(f"{path} is cut short: {file_size} of {header.file_size} bytes")
        return fd, header
    except BaseException:
        os.close(fd)
        raise


def is_out_of_descriptors(exc: KVPoolError) -> bool:
    """Whether an error this module raised means that no file descriptor was left to open the
    file (EMFILE, ENFILE): a state of the moment, not of the file, which is not to be taken
    for a file gone or unreadable."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in _NO_DESCRIPTOR_ERRNOS


def prefetch(path: str | Path) -> None:
    """Ask the kernel to start reading a whole file into the page cache (POSIX_FADV_WILLNEED)
    and return at once: a reader about to read several files advises them all first, so that
    the device works on all of them at once (measured: 64 x 4 MiB files read one after the
    other 0.59 GB/s; advised eight at a time first, 0.83 GB/s). A missing file is ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # Gone or unreadable: the read that follows reports it.
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def read_header(path: str | Path) -> ObjectHeader | None:
    """The header of a file, or None when it is not a whole object file (a scan's question:
    a file shorter than its header says is None too).

    Raises:
        ObjectNotFound: no such file. TransferFailed: it cannot be read.
    """
    with map_exceptions(_READ_ERRORS):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = _read_header_fd(fd)
            if header is not None and os.fstat(fd).st_size != header.file_size:
                return None
            return header
        finally:
            os.close(fd)


def read_scanned_header(entry: os.DirEntry[str]) -> tuple[bool, ObjectHeader | None]:
    """For a tier's scan of its directory: whether `entry` is a file to look at, and its
    header (None when it is no whole object file: the scan removes it). What is not a regular
    file (a directory or a link named like an object file) and a file that cannot be read are
    left alone, with a warning that names them: one stray entry never stops a node or master
    from starting. Blocks."""
    try:
        if not entry.is_file(follow_symlinks=False):
            log.warning("%s is not a regular file: left alone", entry.path)
            return False, None
        return True, read_header(entry.path)
    except ObjectNotFound:  # removed meanwhile
        return False, None
    except (OSError, TransferFailed) as exc:
        log.warning("%s cannot be read: left alone (%s)", entry.path, exc)
        return False, None


def _read_header_fd(fd: int) -> ObjectHeader | None:
    with map_exceptions(_READ_ERRORS):
        head = os.pread(fd, _HEADER_READ_BYTES, 0)
        header = objectfile.decode_header(head)
        if header is None and len(head) == _HEADER_READ_BYTES:
            head = os.pread(fd, objectfile.FIXED_SIZE_BYTES + limits.KEY_SIZE_BYTES_MAX, 0)
            header = objectfile.decode_header(head)
    return header


def read_into(fd: int, header: ObjectHeader, views: Sequence[memoryview], start: int = 0) -> None:
    """Fill `views`, in order, from the object's bytes at `start`.

    Raises:
        TransferFailed: a read error, or the file ends early.
    """
    read_range_into(FileRange(fd, header.header_size + start, sum(len(v) for v in views)), views)


def read_range_into(source: FileRange, views: Sequence[memoryview]) -> None:
    """Fill `views`, in order, from the file range: preadv straight into them, or through a
    bounce buffer into one whose start the kernel's copy out of the page cache would reach
    at one of the slow offsets of frames.payload_padding (the page cache holds the file at its
    own offsets, and an object's data starts a page: a numpy array's data, 16 bytes past a
    page, is that case).

    Raises:
        TransferFailed: a read error, or the file ends early.
    """
    position = source.offset
    with map_exceptions(_READ_ERRORS):
        for view in views:
            if len(view) >= BOUNCE_READ_BYTES_MIN and is_slow_copy(position, buffer_address(view)):
                _read_through_bounce(source.fd, view, position)
            else:
                done = 0
                while done < len(view):
                    done += _read_some(source.fd, view[done:], position + done)
            position += len(view)


def _read_some(fd: int, view: memoryview, position: int) -> int:
    count = os.preadv(fd, [view], position)
    if count == 0:
        raise TransferFailed("object file ends early")
    return count


def _thread_bounce() -> memoryview:
    """This thread's bounce buffer: BOUNCE_BUFFER_BYTES, and a page to start at any offset."""
    bounce = getattr(_bounce, "buffer", None)
    if bounce is None:
        bounce = _bounce.buffer = memoryview(mmap.mmap(-1, BOUNCE_BUFFER_BYTES + PAGE_BYTES))
    return bounce


def _read_through_bounce(fd: int, view: memoryview, position: int) -> None:
    """Read into this thread's bounce buffer at the file's own page offset (the kernel's copy
    is then aligned), then copy into `view` with numpy's SIMD loop (checksums.copy_bytes)."""
    bounce = _thread_bounce()
    done = 0
    while done < len(view):
        at = (position + done) % PAGE_BYTES
        count = _read_some(fd, bounce[at : at + min(BOUNCE_BUFFER_BYTES, len(view) - done)], position + done)
        copy_bytes(bounce[at : at + count], view[done : done + count])
        done += count


def payload_tag_of(mac: Poly1305, payload: Sequence[Part]) -> bytes:
    """frames.payload_tag of a payload that holds file ranges: their bytes read through this
    thread's bounce buffer (the page cache keeps them for the sendfile that follows). Blocks:
    a sending thread's (Connection._send_file_frames).

    Raises:
        TransferFailed: a file could not be read.
    """
    bounce = _thread_bounce()
    for part in payload:
        if not isinstance(part, FileRange):
            mac.update(part)
            continue
        done = 0
        with map_exceptions(_READ_ERRORS):
            while done < part.size:
                count = _read_some(part.fd, bounce[: min(BOUNCE_BUFFER_BYTES, part.size - done)], part.offset + done)
                mac.update(bounce[:count])
                done += count
    return mac.finalize()


def read_object_into(path: str | Path, key: str, size_bytes: int, views: Sequence[memoryview]) -> None:
    """Open, check and read a whole object into `views` (their sizes add up to at least
    `size_bytes`; only the object's bytes are written). Raises as open_object and read_into."""
    fd, header = open_object(path, key, size_bytes)
    try:
        remaining = size_bytes
        parts = []
        for view in views:
            if remaining <= 0:
                break
            parts.append(view[: min(len(view), remaining)])
            remaining -= len(parts[-1])
        read_into(fd, header, parts)
    finally:
        os.close(fd)


def read_object_file(path: str | Path) -> tuple[ObjectHeader, bytes]:
    """A whole object file, header and bytes, from one open descriptor (one version of the
    file, even while writers rename new ones over it). Not checksummed: the caller does.

    Raises:
        ObjectNotFound: no such file. ChecksumMismatch: not an object file.
        TransferFailed: it cannot be read, or ends early.
    """
    with map_exceptions(_READ_ERRORS):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = _read_header_fd(fd)
        if header is None:
            raise ChecksumMismatch(f"{path} is not an object file")
        data = bytearray(header.size)
        read_into(fd, header, [memoryview(data)])
        return header, bytes(data)
    finally:
        os.close(fd)


def read_object_bytes(path: str | Path, key: str, size_bytes: int) -> bytes:
    """Open, check and read a whole object as a new bytes object. Raises as open_object."""
    fd, header = open_object(path, key, size_bytes)
    try:
        with map_exceptions(_READ_ERRORS):
            data = os.pread(fd, size_bytes, header.header_size)
            while len(data) < size_bytes:  # short reads happen on network filesystems
                more = os.pread(fd, size_bytes - len(data), header.header_size + len(data))
                if not more:
                    raise TransferFailed(f"object file of {key!r} ends early")
                data += more
        return data
    finally:
        os.close(fd)


def holds_object(path: str | Path, key: str, size_bytes: int, checksum: int) -> bool:
    """Whether the object file at `path` reads whole and its bytes hash to `checksum`: a file
    gone, torn or unreadable does not (a bad replica's check, on a disk thread). Blocks.

    Raises:
        TransferFailed: no file descriptor was left to open it (is_out_of_descriptors): no
            verdict on the file, whose replica a False would have dropped.
    """
    try:
        data = read_object_bytes(path, key, size_bytes)
    except KVPoolError as exc:
        if is_out_of_descriptors(exc):
            raise TransferFailed(f"no file descriptor left to check {path}") from exc
        return False
    return checksum_of([data]) == checksum


# --- writing -------------------------------------------------------------------------------


def write_object(
    directory: Path,
    name: str,
    key: str,
    checksum: int,
    source: Sequence[memoryview] | FileRange,
    *,
    is_durable: bool,
) -> None:
    """Write an object file atomically: a temporary file, then a rename to `directory/name`.

    Args:
        source: the object's bytes, as views (from a DRAM segment) or as a range of another
            open object file (copied in the kernel: copy_file_range, then sendfile).
        is_durable: fdatasync the file before the rename (call sync_directory afterwards to
            make the rename durable too).

    Raises:
        FilesystemFull: no space left on the filesystem (nothing is left behind).
        TransferFailed: the file could not be written otherwise (nothing is left behind).
    """
    publish(write_temporary(directory, name, key, checksum, source, is_durable=is_durable), directory / name)


def write_temporary(
    directory: Path,
    name: str,
    key: str,
    checksum: int,
    source: Sequence[memoryview] | FileRange,
    *,
    is_durable: bool,
    writer_id: str = "",
) -> Path:
    """Write an object file under a temporary name next to `directory/name`, for `publish` to
    rename into place: a caller that learns meanwhile that the file is no longer wanted (a
    move the master gave up on: node/moves.py) removes it instead, and no file of that name,
    perhaps another object's by then, is ever replaced. Arguments as write_object's;
    `writer_id` is named in the temporary name (objectfile.temp_name).

    Returns:
        The temporary file's path.

    Raises:
        FilesystemFull, TransferFailed: as write_object (nothing is left behind).
    """
    with map_exceptions(_WRITE_ERRORS):
        try:
            return _write_temporary(directory, name, key, checksum, source, is_durable, writer_id)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise FilesystemFull(f"{directory}: {exc.strerror}") from exc
            raise


def publish(temporary: Path, final: Path) -> None:
    """Rename a file write_temporary wrote into place (replacing any file there). Raises
    FilesystemFull (a directory that must grow for the name, on a full filesystem) or
    TransferFailed (the temporary file is removed either way)."""
    with map_exceptions(_WRITE_ERRORS):
        try:
            os.rename(temporary, final)
        except BaseException as exc:
            temporary.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
                raise FilesystemFull(f"{final.parent}: {exc.strerror}") from exc
            raise


def _write_temporary(
    directory: Path,
    name: str,
    key: str,
    checksum: int,
    source: Sequence[memoryview] | FileRange,
    is_durable: bool,
    writer_id: str,
) -> Path:
    size = source.size if isinstance(source, FileRange) else sum(len(v) for v in source)
    temporary = directory / objectfile.temp_name(name, secrets.token_hex(6), writer_id)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        header = objectfile.encode_header(key, size, checksum)
        _write_all(fd, [memoryview(header)], 0)
        if isinstance(source, FileRange):
            _copy_range(source, fd, len(header))
        else:
            _write_all(fd, source, len(header))
        if is_durable:
            os.fdatasync(fd)
        # Written is written: do not keep the bytes in the page cache as well.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    return temporary


def _write_all(fd: int, views: Sequence[memoryview], position: int) -> None:
    for view in views:
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], position + done)
        position += len(view)


def _copy_range(source: FileRange, fd: int, position: int) -> None:
    """Copy a file range into `fd` at `position`, in the kernel where it can."""
    done = 0
    use_copy_file_range = True
    while done < source.size:
        count = min(source.size - done, _COPY_CHUNK_BYTES)
        if use_copy_file_range:
            try:
                copied = os.copy_file_range(source.fd, fd, count, source.offset + done, position + done)
            except OSError as exc:  # EXDEV/ENOSYS/EINVAL: another filesystem or kernel.
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_copy_file_range = False
                continue
        else:
            data = os.pread(source.fd, count, source.offset + done)
            copied = os.pwrite(fd, data, position + done) if data else 0
        if copied == 0:
            raise TransferFailed("source file ended early")
        done += copied


def remove(path: str | Path) -> bool:
    """Unlink a file; False if it was not there. Raises TransferFailed."""
    with map_exceptions(_WRITE_ERRORS):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
    return True


def sync_directory(directory: Path) -> None:
    """fsync a directory: renames and unlinks in it are durable afterwards."""
    with map_exceptions(_WRITE_ERRORS):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_directory(directory: Path) -> None:
    """Create a directory (and its parents) readable only by this user, if absent.

    Raises:
        InvalidParams: it cannot be created or is not a directory.
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # said as an operator reads it, not as "FileExistsError: [Errno 17] ..."
        raise InvalidParams(f"cannot make directory {directory}: {exc.strerror or exc}") from exc


def scan(directory: Path) -> Iterator[os.DirEntry[str]]:
    """The entries of a directory (none if it does not exist). Raises TransferFailed."""
    with map_exceptions(_WRITE_ERRORS):
        try:
            with os.scandir(directory) as entries:
                yield from entries
        except FileNotFoundError:
            return


def modified_s(path: str | Path) -> float | None:
    """A file's mtime in seconds (wall clock), None if it is gone."""
    try:
        return os.stat(path).st_mtime
    except OSError:  # Mapped to "gone": the caller only asks whether to clean it up.
        return None


def statvfs_bytes(directory: Path) -> int:
    """The size of the filesystem holding `directory`. Raises InvalidParams."""
    with map_exceptions({OSError: InvalidParams}):
        stat = os.statvfs(directory)
    return stat.f_blocks * stat.f_frsize


def free_bytes(directory: Path) -> int:
    """What an unprivileged writer may still put on the filesystem holding `directory`.
    Raises InvalidParams."""
    with map_exceptions({OSError: InvalidParams}):
        stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def filesystem_report(directory: Path) -> FilesystemReport:
    """What the filesystem holding `directory` can take: free_bytes on its device (one per
    mounted filesystem on a host), or no writes at all: it is mounted read-only (as ext4
    remounts itself on I/O errors), or `directory` cannot be looked at (gone, unreadable)."""
    try:
        stat = os.statvfs(directory)
        device = os.stat(directory).st_dev
    except OSError:
        return FilesystemReport(is_writable=False)
    if stat.f_flag & os.ST_RDONLY:
        return FilesystemReport(is_writable=False)
    return FilesystemReport(stat.f_bavail * stat.f_frsize, device)


# --- a tier directory: identity and lock ---------------------------------------------------


def load_identity(directory: Path) -> TierIdentity | None:
    """The directory's identity file, or None when absent or unreadable as one."""
    try:
        data = (directory / objectfile.IDENTITY_FILE).read_bytes()
    except OSError:  # Mapped to "none": a missing or unreadable identity is no identity.
        return None
    return objectfile.decode_identity(data)


def store_identity(directory: Path, identity: TierIdentity) -> None:
    """Write the identity file atomically and durably. Raises InvalidParams."""
    path = directory / objectfile.IDENTITY_FILE
    temporary = directory / objectfile.temp_name(objectfile.IDENTITY_FILE, secrets.token_hex(6))
    with map_exceptions({OSError: InvalidParams}):
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, [memoryview(identity.encode())], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    sync_directory(directory)


def lock_directory(directory: Path) -> int:
    """Take the directory's exclusive lock (flock; released when the process dies).

    Returns:
        The lock's descriptor: close it to release the lock.

    Raises:
        InvalidParams: another process holds the lock, or it cannot be taken.
    """
    with map_exceptions({OSError: InvalidParams}):
        # Read-only is enough for flock, and leaves the filesystem free to be remounted
        # read-only while the tier runs (an open file for writing would hold it busy).
        fd = os.open(directory / objectfile.LOCK_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise InvalidParams(f"{directory} is in use by another kvpool process") from exc
        raise InvalidParams(f"cannot lock {directory}: {exc}") from exc
    return fd


# --- sending to a socket -------------------------------------------------------------------


class SendPosition(NamedTuple):
    """How far send_some got: the part, and the bytes of it sent."""

    part: int
    done: int


SEND_START = SendPosition(0, 0)


def send_some(sock_fd: int, parts: Sequence[Part], position: SendPosition) -> SendPosition | None:
    """Write `parts` from `position` to a non-blocking socket, in order, while it takes bytes:
    buffers with os.write, file ranges with os.sendfile (the kernel moves the file's pages to
    the socket). A full socket is waited for here for SEND_ROOM_WAIT_MS at a time, at most
    SEND_CALL_MS_MAX in all; then this returns where it stopped, and the caller waits for room
    without holding a thread (the Connection, on its event loop: a reader that stops reading
    holds no sender thread), then calls again. None once all is sent. Blocks: run it in a
    worker thread, on a dup() of the socket, while nothing else writes to that socket.

    Raises:
        RpcFailed: the socket broke (the peer left, or the connection was shut down).
        TransferFailed: a file could not be read.
    """
    poller: select.poll | None = None
    call_end_s = time.monotonic() + SEND_CALL_MS_MAX / 1000
    for index in range(position.part, len(parts)):
        part = parts[index]
        done = position.done if index == position.part else 0
        view = None if isinstance(part, FileRange) else memoryview(part).cast("B")
        size = part.size if view is None else len(view)
        while done < size:
            try:
                done += _send_once(sock_fd, part, view, done)
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()
                    poller.register(sock_fd, select.POLLOUT)
                if time.monotonic() > call_end_s or not _has_room_within(poller, SEND_ROOM_WAIT_MS):
                    return SendPosition(index, done)
    return None


def _send_once(sock_fd: int, part: Part, view: memoryview | None, done: int) -> int:
    """One write of `part` past its first `done` bytes; the bytes the socket took."""
    if view is not None:
        try:
            return os.write(sock_fd, view[done:])
        except BlockingIOError:
            raise
        except OSError as exc:
            raise RpcFailed(f"socket closed during send: {exc}") from exc
    assert isinstance(part, FileRange)
    try:
        sent = os.sendfile(sock_fd, part.fd, part.offset + done, part.size - done)
    except BlockingIOError:
        raise
    except OSError as exc:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            raise RpcFailed(f"socket closed during sendfile: {exc}") from exc
        raise TransferFailed(f"sendfile: {exc}") from exc
    if sent == 0:
        raise TransferFailed("object file ended before its size")
    return sent


def _has_room_within(poller: select.poll, timeout_ms: int) -> bool:
    """Whether the polled socket takes bytes within `timeout_ms`."""
    for _, event in poller.poll(timeout_ms):
        if event & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            raise RpcFailed("socket closed while waiting to send")
        return True
    return False


def close_parts(parts: Sequence[Part]) -> None:
    """Close the descriptors of the file ranges among `parts` (after sending, or instead),
    each once: ranges may share one, and a second close could hit a descriptor the process
    has opened again since under the same number."""
    for fd in {part.fd for part in parts if isinstance(part, FileRange)}:
        try:
            os.close(fd)
        except OSError:  # Already closed: nothing to release.
            pass
