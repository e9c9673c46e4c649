"""The shared-filesystem (DFS) tier's directory, as every process sees it.

Operators mount one distributed filesystem (NFS, Lustre, WEKA, VAST, 3FS) on every server; its
kvpool directory holds one object file per DFS replica (protocol/objectfile.py names them by
key hash and offset). The master creates the directory's identity (a segment id "dfs-<hex>"
and a token) and indexes its files; nodes write objects into it (offload, write-through) and
read them back (promotion); clients read them straight from the path, with no node involved,
so DFS objects outlive every node. `DfsDirectory` is that directory: names, identity, atomic
writes, reads, removal and the scan a master rebuilds its index from. It is not the index
(the master's) and decides nothing.

Sameness is proven, not assumed from a path: a reader uses its own mount point of the DFS and
checks that the identity it finds there has the token (or segment id) the master announced,
so the path may differ from host to host.

    <dfs_dir>/kvpool-tier.json                      identity: tier "dfs", segment id, token
    <dfs_dir>/objects/<2 hex>/<32 hex>-<12 hex>.kvo one object (key hash, offset in the tier)
    <dfs_dir>/objects/<2 hex>/....kvo.<writer>.<hex>.tmp   being written by the node <writer> names

A temporary file whose writer is gone (a node killed mid-copy) is removed by the master: once
it finds that writer gone (remove_stale_temporaries, `tags_gone`), or an hour after the file
was last written (its writer unknown: a name without a writer, a master restarted since).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

from kvpool import limits
from kvpool.errors import FilesystemFull, InvalidParams, KVPoolError, TransferFailed
from kvpool.protocol import objectfile
from kvpool.protocol.messages import TIER_DFS, InventoryEntry
from kvpool.protocol.objectfile import TierIdentity
from kvpool.transports import files
from kvpool.transports.files import FileRange


def _make_root(path: Path) -> None:
    """Create a DFS tier's directory, if absent, in a directory that exists: a shared
    filesystem that is not mounted must not become a directory of this host's own disk, its
    parents made up on the way.

    Raises:
        InvalidParams: its parent is not a directory, or it cannot be created.
    """
    if not path.parent.is_dir():
        raise InvalidParams(f"{path}: {path.parent} is not a directory (is the shared filesystem mounted?)")
    files.make_directory(path)


def _make_bucket(bucket: Path) -> None:
    """Create an object's bucket directory, if absent, in the tier's objects directory, which
    must be there: were its parents made up on the way, a share unmounted under a running node
    (its mount point left empty) became this host's own disk, and offloads went on, "ok", into
    files no other host could read.

    Raises:
        FilesystemFull: no room for the bucket. TransferFailed: the objects directory is gone, or
            the bucket cannot be made.
    """
    try:
        os.mkdir(bucket, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError as exc:
        raise TransferFailed(f"{bucket.parent} is gone (is the shared filesystem mounted?)") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # as a full write: the master caps the tier
            raise FilesystemFull(f"cannot make directory {bucket}: {exc.strerror}") from exc
        raise TransferFailed(f"cannot make directory {bucket}: {exc.strerror or exc}") from exc


class DfsDirectory:
    """One process's view of the DFS directory at `path` (identity loaded on demand)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.objects_path = self.path / objectfile.OBJECTS_DIR
        self._identity: TierIdentity | None = None

    def __repr__(self) -> str:
        segment_id = self._identity.segment_id if self._identity else "?"
        return f"<DfsDirectory {self.path} {segment_id}>"

    # --- identity ------------------------------------------------------------------------

    @classmethod
    def create_or_open(
        cls, path: str | Path, capacity_bytes: int, owner: str = "", also_owners: Sequence[str] = ()
    ) -> DfsDirectory:
        """The master's open: create the directory and its identity on first use, of
        `capacity_bytes` (0: the filesystem's size, up to the largest segment), marked as
        `owner`'s (auth.cluster_mark). `also_owners`: marks of this cluster's other tokens (a
        token rotating in or out: auth.Keyring); a directory marked with one is marked `owner`'s.

        A later start keeps the stored capacity (objects beyond a smaller one would be lost).
        A directory another cluster uses is refused: each master allocates the tier's offsets
        alone, indexes every file in it and removes the ones it does not know, so two clusters
        on one directory served and removed each other's objects. One written before owners
        were recorded is taken.

        Raises:
            InvalidParams: the directory cannot be created (_make_root), belongs to another
                tier, or to another cluster.
        """
        directory = cls(path)
        _make_root(directory.path)
        files.make_directory(directory.objects_path)
        identity = files.load_identity(directory.path)
        if identity is None:
            if not capacity_bytes:
                capacity_bytes = min(files.statvfs_bytes(directory.path), limits.SEGMENT_SIZE_BYTES_MAX)
            identity = TierIdentity(
                TIER_DFS, f"dfs-{secrets.token_hex(4)}",
                secrets.token_bytes(limits.SEGMENT_TOKEN_SIZE_BYTES), capacity_bytes, owner,
            )  # fmt: skip
            files.store_identity(directory.path, identity)
        else:
            identity = directory._owned(identity, owner, also_owners)
        directory._identity = identity
        return directory

    def mark_owner(self, owner: str, also_owners: Sequence[str]) -> None:
        """Mark this directory `owner`'s where it is marked with one of `also_owners` (a master
        whose tokens were replaced). Never creates an identity: a share unmounted under a
        running master shows an empty mount point, which is not this tier.

        Raises:
            InvalidParams: no identity, another tier's, or another cluster's.
        """
        identity = files.load_identity(self.path)
        if identity is None:
            raise InvalidParams(f"{self.path} holds no DFS identity (not mounted?)")
        self._owned(identity, owner, also_owners)

    def _owned(self, identity: TierIdentity, owner: str, also_owners: Sequence[str]) -> TierIdentity:
        """`identity`, marked `owner`'s (stored so) if it was one of `also_owners` or unmarked.

        Raises:
            InvalidParams: another tier's, or another cluster's.
        """
        if identity.tier != TIER_DFS:
            raise InvalidParams(f"{self.path} is a {identity.tier} tier, not a DFS directory")
        if identity.owner == owner:
            return identity
        if identity.owner and identity.owner not in also_owners:
            raise InvalidParams(
                f"{self.path} is the DFS tier of another cluster (another cluster token): give each "
                "cluster a --dfs-dir of its own"
            )
        identity = identity._replace(owner=owner)
        files.store_identity(self.path, identity)
        return identity

    def identity(self) -> TierIdentity | None:
        """The identity found in the directory (cached once found), or None."""
        if self._identity is None:
            identity = files.load_identity(self.path)
            if identity is not None and identity.tier == TIER_DFS:
                self._identity = identity
        return self._identity

    def known_segment_id(self) -> str:
        """The segment id of the identity read so far ("" before one was found). No I/O."""
        identity = self._identity
        return identity.segment_id if identity is not None else ""

    def is_segment(self, segment_id: str) -> bool:
        """True when this directory is the DFS the master mounts as `segment_id`."""
        identity = self.identity()
        if identity is not None and identity.segment_id != segment_id:
            identity = self._identity_again()
        return identity is not None and identity.segment_id == segment_id

    def has_token(self, token: bytes) -> bool:
        """True when this directory is the DFS whose token the master announced."""
        identity = self.identity()
        if identity is not None and identity.token != token:
            identity = self._identity_again()
        return identity is not None and bool(token) and identity.token == token

    def _identity_again(self) -> TierIdentity | None:
        """The identity read anew: the master may have made a new one (the directory emptied
        by an operator, then the master restarted), which a node that kept the old refused
        every DFS move against until it restarted. The one known stays until the new one is
        read: a move that already looked finds one meanwhile (a hung share reads for long)."""
        identity = files.load_identity(self.path)
        if identity is not None and identity.tier == TIER_DFS:
            self._identity = identity
        return self._identity

    # --- objects -------------------------------------------------------------------------

    def path_of(self, key: str, offset: int) -> Path:
        return self.path / objectfile.dfs_relative_path(key, offset)

    def write_temporary(
        self, key: str, offset: int, checksum: int, source: Sequence[memoryview] | FileRange,
        *, is_durable: bool, writer_id: str = "",
    ) -> Path:  # fmt: skip
        """Write one object under a temporary name in its bucket, for `publish` (or removal:
        a move no longer wanted), the name tagged with `writer_id` when given (the writing
        node's DRAM segment id: the master removes the file once that segment is gone; an
        untagged one an hour after it was last written). Blocks.

        Raises:
            FilesystemFull: no space left there. TransferFailed: it could not be written
            otherwise (nothing is left behind in either case).
        """
        final = self.path_of(key, offset)
        _make_bucket(final.parent)
        return files.write_temporary(
            final.parent, final.name, key, checksum, source, is_durable=is_durable, writer_id=writer_id
        )

    def publish(self, key: str, offset: int, temporary: Path, *, is_durable: bool) -> None:
        """Rename a file write_temporary wrote into place (and sync its bucket when
        `is_durable`). Blocks. Raises TransferFailed (the temporary file is removed)."""
        final = self.path_of(key, offset)
        files.publish(temporary, final)
        if is_durable:
            try:
                files.sync_directory(final.parent)
            except KVPoolError:
                # Failed, the move leaves no file: one left whole at its name was in no index
                # and in no free-space count, and the master's next start adopted it.
                with contextlib.suppress(KVPoolError):
                    files.remove(final)
                raise

    def read_into(self, key: str, offset: int, size_bytes: int, views: Sequence[memoryview]) -> None:
        """Read a whole object into `views`. Blocks. Raises as files.read_object_into."""
        files.read_object_into(self.path_of(key, offset), key, size_bytes, views)

    def read_bytes(self, key: str, offset: int, size_bytes: int) -> bytes:
        """Read a whole object. Blocks. Raises as files.read_object_bytes."""
        return files.read_object_bytes(self.path_of(key, offset), key, size_bytes)

    def remove(self, key: str, offset: int) -> bool:
        """Unlink one object's file; False if it was gone. Blocks. Raises TransferFailed."""
        return files.remove(self.path_of(key, offset))

    def scan(self, temp_age_ms_max: int) -> Iterator[InventoryEntry]:
        """Every whole object file, as an inventory entry (offset: its offset in the tier).

        Removes what cannot be an object: temporary files older than `temp_age_ms_max` (their
        writer is gone) and files whose header is not whole. Foreign files are left alone.
        O(files): a master runs it once, at start. Blocks.
        """
        now_s = time.time()
        for bucket in files.scan(self.objects_path):
            if not bucket.is_dir():
                continue
            for entry in files.scan(Path(bucket.path)):
                name = entry.name
                if objectfile.is_temp_name(name):
                    _remove_if_stale(entry.path, now_s, temp_age_ms_max)
                    continue
                offset = objectfile.dfs_offset_of(name)
                if offset is None:
                    continue
                is_file, header = files.read_scanned_header(entry)
                if not is_file:
                    continue
                if header is None or objectfile.dfs_relative_path(header.key, offset) != (
                    f"{objectfile.OBJECTS_DIR}/{bucket.name}/{name}"
                ):
                    files.remove(entry.path)  # Torn or misplaced: never an object to serve.
                    continue
                yield InventoryEntry(header.key, offset, header.size, header.checksum)

    def remove_stale_temporaries(
        self, temp_age_ms_max: int, keep_going: Callable[[], bool], tags_gone: Collection[str] = ()
    ) -> tuple[int, int]:
        """Remove the temporary files whose writer is gone: those tagged with one of
        `tags_gone` (objectfile.writer_tag), and any older than `temp_age_ms_max` (as `scan`
        does), without reading any object, while `keep_going()` (asked before each file);
        returns how many were removed and how many could not be (a file, or a whole bucket
        that cannot be listed, stops no other). `tags_gone` is looked up at each file: a
        caller may take a tag out meanwhile (its writer came back), and the files that writer
        writes from then on stay. O(files): a running master calls it rarely
        (server.DFS_TEMP_SWEEP_INTERVAL_MS, DFS_GONE_WRITERS_SWEEP_INTERVAL_MS). Blocks.

        Raises:
            TransferFailed: the objects directory cannot be read.
        """
        now_s = time.time()
        removed = failed = 0
        for bucket in files.scan(self.objects_path):
            try:
                if not bucket.is_dir():  # may stat (a filesystem that reports no file types)
                    continue
                for entry in files.scan(Path(bucket.path)):
                    if not keep_going():
                        return removed, failed
                    if objectfile.is_temp_name(entry.name):
                        try:
                            if objectfile.temp_writer_of(entry.name) in tags_gone:
                                removed += files.remove(entry.path)
                            else:
                                removed += _remove_if_stale(entry.path, now_s, temp_age_ms_max)
                        except TransferFailed:
                            failed += 1
            except (TransferFailed, OSError):  # the bucket cannot be listed (EACCES, ESTALE, EIO)
                failed += 1
        return removed, failed


def _remove_if_stale(path: str, now_s: float, temp_age_ms_max: int) -> bool:
    """Remove a temporary file last written over `temp_age_ms_max` ago; True if removed."""
    modified_s = files.modified_s(path)
    return modified_s is not None and (now_s - modified_s) * 1000 > temp_age_ms_max and files.remove(path)
