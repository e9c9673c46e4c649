"""A node's disk tier: a directory of object files on local NVMe, mounted like a segment.

The disk tier holds objects that DRAM had no room for (offload on evict), copies asked for at
put (write-through), and keeps them across restarts. The master accounts it as one more
segment of the node (SegmentInfo.tier "disk"): it allocates a range of the tier's capacity for
each object, and that range's offset names the object's file. `DiskTier` is the directory,
its identity and lock, and the inventory of the complete files in it; it is not where objects
are copied (node/moves.py), nor how they are served (node/tiered.py), nor where eviction is
decided (the master).

    <disk_dir>/kvpool-tier.json     identity: tier "disk", segment id, token, capacity
    <disk_dir>/kvpool-tier.lock     flock'ed while a node uses the directory
    <disk_dir>/objects/<offset>.kvo one complete object (protocol/objectfile.py)
    <disk_dir>/objects/*.tmp        being written; removed at the next start

Crash consistency (docs/tiers.md): a file is written under a temporary name and renamed into
place only once whole (fdatasync'ed first, and the directory fsync'ed before the master hears
of it, when `is_durable`), so a node killed at any moment leaves whole files or temporary ones.
At start every file's header is checked (key, size, checksum of the header itself and the
file's length), torn or foreign ones are removed, and the survivors are the inventory the node
re-mounts with. The object's own checksum is in the header; every reader verifies it after
every read, so even bytes rotted on the device are never served as the object.

The identity keeps the segment id and token stable across restarts: a restarted node mounts
the same disk segment again (a new node id is fine: the token proves the directory), and the
master re-adopts its objects without any client writing them anew.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kvpool import limits
from kvpool.errors import InvalidParams, ObjectNotFound, TransferFailed
from kvpool.node.inventory import Inventory
from kvpool.protocol import objectfile
from kvpool.protocol.messages import TIER_DISK, FilesystemReport, InventoryEntry, SegmentInfo
from kvpool.protocol.objectfile import TierIdentity
from kvpool.transports import files
from kvpool.transports.files import FileRange

log = logging.getLogger(__name__)

# A tier of a million files takes its node tens of seconds to adopt at start, before it serves:
# said at this interval, so that a node that is reading is not taken for one that hangs.
ADOPT_PROGRESS_LOG_INTERVAL_S = 10.0


class DiskTier:
    """An open disk tier directory: identity, lock and inventory of complete object files.

    The inventory is changed on the event loop only (`record`, `forget`); file I/O runs in
    worker threads (write_temporary, publish, remove_files, open_range). Invariant: every
    inventory entry has a whole file named `disk_name(entry.offset)`; a file without an entry
    is either being written (a temporary name), about to be removed, or one a drop could not
    remove (`unremoved`: a read-only filesystem).
    """

    def __init__(self, directory: Path, identity: TierIdentity, lock_fd: int, is_durable: bool) -> None:
        self.directory = directory
        self.objects_path = directory / objectfile.OBJECTS_DIR
        self.identity = identity
        self.is_durable = is_durable
        self.inventory = Inventory(identity.capacity_bytes)
        # Offset -> entry the master dropped whose file could not be removed (a read-only
        # filesystem): served no more, and the drop is acknowledged only once the file is gone,
        # so the master neither reuses its range nor forgets that the node still has it.
        self.unremoved: dict[int, InventoryEntry] = {}
        self._lock_fd: int | None = lock_fd
        # Held by a publish's rename and by a removal's look at a file and its unlink: a file
        # named by offset may be another object's by the time its removal runs (_drop_rejected:
        # the master never gave the refused entry its range, and may have granted it to a move).
        self._files_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<DiskTier {self.directory} {self.segment_id} {self.inventory!r}>"

    @property
    def segment_id(self) -> str:
        return self.identity.segment_id

    @property
    def token(self) -> bytes:
        return self.identity.token

    @property
    def capacity_bytes(self) -> int:
        return self.identity.capacity_bytes

    @classmethod
    def open(cls, directory: str | Path, capacity_bytes: int, node_id: str, *, is_durable: bool) -> DiskTier:
        """Open (or create) the disk tier at `directory` and adopt the object files in it.

        The capacity is fixed when the directory is created; a later start with another
        size keeps the stored one (and says so), so that no adopted object falls outside it.

        Raises:
            InvalidParams: the directory cannot be used, is locked by another process, or is
                another tier's.
        """
        path = Path(directory)
        if files.load_identity(path) is None:  # checked before creating anything: a refusal leaves no directory
            _check_new_tier(path, capacity_bytes)
        files.make_directory(path / objectfile.OBJECTS_DIR)
        lock_fd = files.lock_directory(path)
        try:
            identity = files.load_identity(path)
            if identity is None:
                _check_new_tier(path, capacity_bytes)  # again, under the lock
                identity = TierIdentity(
                    TIER_DISK, f"{node_id}-{secrets.token_hex(4)}/disk",
                    secrets.token_bytes(limits.SEGMENT_TOKEN_SIZE_BYTES), capacity_bytes,
                )  # fmt: skip
                files.store_identity(path, identity)
            elif identity.tier != TIER_DISK:
                raise InvalidParams(f"{path} is a {identity.tier} tier, not a disk tier")
            elif capacity_bytes and identity.capacity_bytes != capacity_bytes:
                log.warning("disk tier %s keeps its capacity of %d bytes (asked: %d): a tier's size is fixed when "
                            "it is made; to resize it, start the node on an empty directory (its objects go: "
                            "docs/tiers.md \"Operating\")", path, identity.capacity_bytes, capacity_bytes)  # fmt: skip
            tier = cls(path, identity, lock_fd, is_durable)
            tier._adopt_files()
        except BaseException:
            os.close(lock_fd)
            raise
        return tier

    def close(self) -> None:
        """Release the directory lock (files stay: they are the tier)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def info(self, node_id: str, hostname: str, endpoint: str, is_shared: bool) -> SegmentInfo:
        """The disk segment as the master and clients see it. `is_shared`: same-host clients
        may read the files directly (they find them at shm_path and check the token). The
        token is always there: it is also how the master knows a restarted node's disk tier."""
        return SegmentInfo(
            segment_id=self.segment_id,
            node_id=node_id,
            hostname=hostname,
            endpoint=endpoint,
            shm_path=str(self.directory) if is_shared else "",
            shm_token=self.token,
            capacity_bytes=self.capacity_bytes,
            tier=TIER_DISK,
        )

    def path_of(self, offset: int) -> Path:
        return self.objects_path / objectfile.disk_name(offset)

    # --- inventory (event loop) -----------------------------------------------------------

    def entry_at(self, key: str, offset: int) -> InventoryEntry | None:
        entry = self.inventory.get(key)
        return entry if entry is not None and entry.offset == offset else None

    def record(self, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        """Record whole files in the inventory. Returns the entries they displaced (the
        master lost track of those: the newest wins), for the caller to remove their files."""
        written = {entry.offset for entry in entries}
        displaced = self.inventory.add(entries)
        if displaced:
            log.warning("disk tier %s: %d objects displaced: %s", self.segment_id, len(displaced),
                        [entry.key for entry in displaced[:8]])  # fmt: skip
        for offset in written & self.unremoved.keys():
            del self.unremoved[offset]  # its file was replaced by the rename: no drop may remove it now
        # A displaced entry at the offset of a new one that stays shared its file name: that
        # file is the new one's now (the rename replaced it), so it must stay. Any other
        # displaced file goes, a new entry's too when a later one displaced it (at adoption
        # every file is new: an older file a newer one overlaps, or an older copy of its key).
        kept = {entry.offset for entry in entries if self.inventory.get(entry.key) == entry}
        return [e for e in displaced if e.offset not in kept]

    def forget(self, entries: Iterable[InventoryEntry]) -> list[InventoryEntry]:
        """Drop entries (by key and offset) from the inventory; returns them, and those an
        earlier drop could not remove the files of, for the caller to remove before it
        acknowledges the drop."""
        entries = list(entries)
        dropped = self.inventory.drop(entries)
        unremoved = self.unremoved
        for entry in entries if unremoved else ():
            held = unremoved.get(entry.offset)
            if held is not None and held.key == entry.key:
                dropped.append(unremoved.pop(entry.offset))
        return dropped

    # --- files (worker threads) -----------------------------------------------------------

    def write_temporary(self, entry: InventoryEntry, source: list[memoryview] | FileRange) -> Path:
        """Write the file of `entry` under a temporary name, for `publish` (or removal: a move
        no longer wanted). Raises FilesystemFull, TransferFailed (nothing is left behind)."""
        assert 0 <= entry.offset and entry.offset + entry.size <= self.capacity_bytes, entry
        return files.write_temporary(
            self.objects_path, objectfile.disk_name(entry.offset), entry.key, entry.checksum,
            source, is_durable=self.is_durable,
        )  # fmt: skip

    def publish(self, entry: InventoryEntry, temporary: Path) -> None:
        """Rename a file write_temporary wrote to `entry`'s name (sync() makes it durable).
        Raises TransferFailed (the temporary file is removed)."""
        with self._files_lock:
            files.publish(temporary, self.path_of(entry.offset))

    def filesystem_report(self) -> FilesystemReport:
        """What the filesystem under the tier can take, for the master (files.filesystem_report):
        nothing once its objects directory is gone (removed by hand), where every write would fail."""
        return files.filesystem_report(self.objects_path)

    def sync(self) -> None:
        """Make renames and unlinks durable (when the tier is durable). Raises TransferFailed."""
        if self.is_durable:
            files.sync_directory(self.objects_path)

    def remove_files(self, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        """Remove the files of forgotten entries, then sync the directory. Returns the entries
        whose file could not be removed (a read-only filesystem). Raises TransferFailed: the
        sync failed."""
        left: list[InventoryEntry] = []
        for entry in entries:
            try:
                with self._files_lock:
                    if self._holds(entry):
                        files.remove(self.path_of(entry.offset))
            except TransferFailed:
                left.append(entry)
        if len(left) < len(entries):
            self.sync()
        return left

    def _holds(self, entry: InventoryEntry) -> bool:
        """Whether `entry`'s file name holds `entry`'s object (or no readable object): not
        another object's a move has published there since. A refused inventory entry's
        removal deleted the file of the object the master had placed at its offset meanwhile,
        and the master listed a replica without a file (a history run, 2026-12-07)."""
        try:
            header = files.read_header(self.path_of(entry.offset))
        except ObjectNotFound:
            return False
        except TransferFailed:
            return True  # unreadable: not another object's, as far as anyone can tell
        return header is None or header.key == entry.key

    def open_range(
        self, entry: InventoryEntry, offset: int, size_bytes: int, opened: dict[int, tuple[int, int]] | None = None
    ) -> FileRange:
        """The bytes [offset, offset + size) of the tier, which lie in `entry`'s file, as an
        open file range (the receiver closes it).

        Args:
            opened: the files opened so far for the same payload, by entry offset: (descriptor,
                where the object's bytes start in it). A file found there is not opened again,
                and its ranges share the descriptor (files.close_parts closes it once): a
                frame of 1,024 pages of one object holds one descriptor, not 1,024.

        Raises:
            ObjectNotFound: the file is gone. ChecksumMismatch: it holds another object.
            TransferFailed: it cannot be read, or no descriptor is left
                (files.is_out_of_descriptors).
        """
        assert entry.offset <= offset and offset + size_bytes <= entry.offset + entry.size, (entry, offset)
        found = opened.get(entry.offset) if opened is not None else None
        if found is None:
            fd, header = files.open_object(self.path_of(entry.offset), entry.key, entry.size)
            found = (fd, header.header_size)
            if opened is not None:
                opened[entry.offset] = found
        fd, data_start = found
        start = data_start + offset - entry.offset
        # Read ahead now: the ranges of a frame are opened together and sent one by one. Only
        # advice: a refusal of it is no read's failure (raised, it was no KVPoolError, and the
        # reader got no reply but its timeout).
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, start, size_bytes, os.POSIX_FADV_WILLNEED)
        return FileRange(fd, start, size_bytes)

    def containing(self, offset: int, size_bytes: int) -> InventoryEntry:
        """The one object whose bytes hold [offset, offset + size). Raises ObjectNotFound."""
        found = self.inventory.overlapping(offset, size_bytes)
        if len(found) != 1 or found[0].offset > offset or found[0].offset + found[0].size < offset + size_bytes:
            raise ObjectNotFound(
                f"disk tier {self.segment_id} holds no object at [{offset}, +{size_bytes})"
            )
        return found[0]

    def _adopt_files(self) -> None:
        """Build the inventory from the files in the directory (at start, before serving)."""
        found: list[tuple[float, InventoryEntry]] = []
        removed = 0
        started_s = said_s = time.monotonic()
        for read, item in enumerate(files.scan(self.objects_path)):
            if read and read % 1024 == 0 and time.monotonic() - said_s >= ADOPT_PROGRESS_LOG_INTERVAL_S:
                said_s = time.monotonic()
                log.info("disk tier %s at %s: adopting its files, %d read in %.0f s", self.segment_id,
                         self.directory, read, said_s - started_s)  # fmt: skip
            name = item.name
            if objectfile.is_temp_name(name):
                files.remove(item.path)  # A write that never finished: no one knows of it.
                removed += 1
                continue
            offset = objectfile.disk_offset_of(name)
            if offset is None:
                continue  # Not ours: left alone.
            is_file, header = files.read_scanned_header(item)
            if not is_file:
                continue
            if header is None or offset + header.size > self.capacity_bytes:
                files.remove(item.path)
                removed += 1
                continue
            modified_s = files.modified_s(item.path) or 0.0
            found.append((modified_s, InventoryEntry(header.key, offset, header.size, header.checksum)))
        # Oldest first, so that if two files ever overlapped the newer one wins.
        found.sort(key=lambda pair: (pair[0], pair[1].offset))
        entries = [entry for _, entry in found]
        stale = self.record(entries)
        self.remove_files(stale)
        if removed:
            self.sync()
        log.info("disk tier %s at %s: adopted %d objects (%d bytes), removed %d stray files",
                 self.segment_id, self.directory, len(self.inventory), self.inventory.used_bytes,
                 removed + len(stale))  # fmt: skip


def _check_new_tier(path: Path, capacity_bytes: int) -> None:
    """Raises InvalidParams: a new tier without a size, of a size out of bounds, or larger
    than the free space of its filesystem (said plainly now rather than as failed offloads
    once the filesystem fills; measured where the directory is, or would be made)."""
    if not capacity_bytes:
        raise InvalidParams(f"{path} holds no disk tier yet: give its size (--disk-size)")
    if not limits.SEGMENT_SIZE_BYTES_MIN <= capacity_bytes <= limits.SEGMENT_SIZE_BYTES_MAX:
        raise InvalidParams(
            f"disk size {capacity_bytes} out of [{limits.SEGMENT_SIZE_BYTES_MIN}, {limits.SEGMENT_SIZE_BYTES_MAX}]"
        )
    existing = next((p for p in (path, *path.absolute().parents) if p.is_dir()), path)
    free_bytes = files.free_bytes(existing)
    if capacity_bytes > free_bytes:
        raise InvalidParams(
            f"a disk tier of {capacity_bytes} bytes (--disk-size) does not fit in {path} ({free_bytes} bytes "
            "free): ask for less, or give that filesystem more room"
        )
