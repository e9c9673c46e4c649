"""The object file: how one object is laid out in a file of a disk tier or the shared filesystem.

A node's disk tier and the DFS tier both keep each object in a file of its own, written under a
temporary name and renamed into place once complete (a reader, or a restarted node, never sees
half a file). This module is the file's format and the files' names, as pure functions: bytes
in, records out, no I/O (transports/files.py does the I/O). It is not where objects are placed
(the master decides) nor how they are read back (nodes and clients).

    0        8         12            16        24          32        36         40         48
    +--------+---------+-------------+---------+-----------+---------+----------+----------+
    | magic  | version | header_size | size    | checksum  | key_len | reserved | hdr_sum  |
    +--------+---------+-------------+---------+-----------+---------+----------+----------+
    48                       48 + key_len                    header_size (a multiple of 4 KiB)
    +------------------------+--------------------------------+------------------------------+
    | key (UTF-8)            | zeros                          | object bytes (size)  ...     |
    +------------------------+--------------------------------+------------------------------+

`checksum` is the object's xxh3-64 (the checksum the master records, verified by every reader
after every read); `hdr_sum` is the xxh3-64 of the 40 bytes before it and the key, so a torn or
foreign header is recognised as such. The data starts on a 4 KiB boundary, so that it can be
read with O_DIRECT and sent with sendfile from an aligned offset.

Names. A disk tier file is named by the offset the master accounts the object at in that tier
(the offset of its `Replica`), so a replica names its file and no two live objects share one:

    <disk_dir>/objects/<offset as 12 hex digits>.kvo

A DFS file is named by its key's hash and its offset in the DFS tier, so that readers on any
host find it from (key, replica) alone, and a new copy of a key never takes an old copy's name:

    <dfs_dir>/objects/<2 hex>/<xxh3-128 of the key, 32 hex>-<offset, 12 hex>.kvo

A file being written is `<final name>.<random hex>.tmp` in the same directory; a DFS one also
names its writer, so that the master can remove it once that writer is gone (temp_name):

    <dfs_dir>/objects/<2 hex>/<final name>.<writer tag, 16 hex>.<random hex>.tmp
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

import xxhash

from kvpool import limits

MAGIC = b"KVPOOLOB"
VERSION = 1
_FIXED = struct.Struct("<8sIIQQII")  # magic, version, header size, size, checksum, key len, 0
_HEADER_SUM = struct.Struct("<Q")
FIXED_SIZE_BYTES = _FIXED.size + _HEADER_SUM.size
ALIGN_BYTES = limits.PAGE_SIZE_BYTES
OBJECTS_DIR = "objects"
SUFFIX = ".kvo"
TEMP_SUFFIX = ".tmp"
IDENTITY_FILE = "kvpool-tier.json"
LOCK_FILE = "kvpool-tier.lock"
_OFFSET_HEX_DIGITS = 12  # 48 bits: more than any offset (SEGMENT_SIZE_BYTES_MAX is 2**47).
_RANDOM_HEX_DIGITS = 12
_WRITER_TAG_HEX_DIGITS = 16  # xxh3-64: a fixed length whatever the writer's id
# The longest name a file of a tier takes: a DFS temporary file's (filesystems allow 255 bytes).
NAME_BYTES_MAX = (
    32 + 1 + _OFFSET_HEX_DIGITS + len(SUFFIX) + 1 + _WRITER_TAG_HEX_DIGITS + 1 + _RANDOM_HEX_DIGITS + len(TEMP_SUFFIX)
)

assert FIXED_SIZE_BYTES == 48
assert limits.SEGMENT_SIZE_BYTES_MAX < 16**_OFFSET_HEX_DIGITS
assert ALIGN_BYTES % 512 == 0  # O_DIRECT's alignment on every Linux block device
assert NAME_BYTES_MAX <= 255


class ObjectHeader(NamedTuple):
    """A decoded header: whose bytes the file holds and where they start."""

    key: str
    size: int
    checksum: int
    header_size: int

    @property
    def file_size(self) -> int:
        return self.header_size + self.size


def header_size_for(key: str) -> int:
    """Bytes before the data for `key`: the fixed part and the key, rounded up to 4 KiB."""
    raw = FIXED_SIZE_BYTES + len(key.encode())
    return -(-raw // ALIGN_BYTES) * ALIGN_BYTES


def encode_header(key: str, size: int, checksum: int) -> bytes:
    """The header of an object file, padded to its header size."""
    assert size > 0, size
    assert 0 <= checksum < 2**64, checksum
    key_bytes = key.encode()
    header_size = header_size_for(key)
    fixed = _FIXED.pack(MAGIC, VERSION, header_size, size, checksum, len(key_bytes), 0)
    header_sum = xxhash.xxh3_64_intdigest(fixed + key_bytes)
    head = fixed + _HEADER_SUM.pack(header_sum) + key_bytes
    return head + bytes(header_size - len(head))


def decode_header(data: bytes | memoryview) -> ObjectHeader | None:
    """The header at the start of `data`, or None if `data` does not start with a whole, valid
    one (a foreign file, a torn header, a key that is cut off: read more and retry, or treat
    the file as not an object)."""
    if len(data) < FIXED_SIZE_BYTES:
        return None
    magic, version, header_size, size, checksum, key_len, reserved = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or reserved != 0:
        return None
    if key_len == 0 or key_len > limits.KEY_SIZE_BYTES_MAX or size <= 0:
        return None
    if header_size % ALIGN_BYTES or header_size < FIXED_SIZE_BYTES + key_len:
        return None
    if len(data) < FIXED_SIZE_BYTES + key_len:
        return None
    (header_sum,) = _HEADER_SUM.unpack_from(data, _FIXED.size)
    key_bytes = bytes(data[FIXED_SIZE_BYTES : FIXED_SIZE_BYTES + key_len])
    if xxhash.xxh3_64_intdigest(bytes(data[: _FIXED.size]) + key_bytes) != header_sum:
        return None
    try:
        key = key_bytes.decode()
    except UnicodeDecodeError:
        return None
    return ObjectHeader(key, size, checksum, header_size)


# --- names -----------------------------------------------------------------------------------


def disk_name(offset: int) -> str:
    """The file name of the disk tier object the master accounts at `offset`."""
    assert 0 <= offset < 16**_OFFSET_HEX_DIGITS, offset
    return f"{offset:0{_OFFSET_HEX_DIGITS}x}{SUFFIX}"


def disk_offset_of(name: str) -> int | None:
    """The offset a disk tier file name stands for, or None if it is not such a name."""
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != _OFFSET_HEX_DIGITS:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def key_hash(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode())


def dfs_relative_path(key: str, offset: int) -> str:
    """Where a DFS object lives below the DFS directory (see the module docstring)."""
    assert 0 <= offset < 16**_OFFSET_HEX_DIGITS, offset
    digest = key_hash(key)
    return f"{OBJECTS_DIR}/{digest[:2]}/{digest}-{offset:0{_OFFSET_HEX_DIGITS}x}{SUFFIX}"


def dfs_offset_of(name: str) -> int | None:
    """The DFS offset a DFS file name carries, or None if it is not such a name."""
    if not name.endswith(SUFFIX):
        return None
    digest, dash, offset_hex = name[: -len(SUFFIX)].rpartition("-")
    if not dash or len(digest) != 32 or len(offset_hex) != _OFFSET_HEX_DIGITS:
        return None
    try:
        int(digest, 16)
        return int(offset_hex, 16)
    except ValueError:
        return None


def is_temp_name(name: str) -> bool:
    return name.endswith(TEMP_SUFFIX)


def writer_tag(writer_id: str) -> str:
    """What a temporary file's name says of its writer: the hash of its id (a node's DRAM
    segment id, new at each start), of one length and alphabet whatever the id is."""
    return xxhash.xxh3_64_hexdigest(writer_id.encode())


def temp_name(final_name: str, random_hex: str, writer_id: str = "") -> str:
    """The name a file is written under before it is renamed to `final_name`: random, so that
    two writers of one name never share a temporary file, and tagged with `writer_id` when
    given (DFS files: the master removes a gone writer's, temp_writer_of)."""
    assert len(random_hex) == _RANDOM_HEX_DIGITS, random_hex
    writer = f".{writer_tag(writer_id)}" if writer_id else ""
    return f"{final_name}{writer}.{random_hex}{TEMP_SUFFIX}"


def temp_writer_of(name: str) -> str | None:
    """The writer tag a temporary file's name carries, or None (no temporary file's name, or
    one written without a writer: before 2026-12-06, a disk tier's)."""
    if not is_temp_name(name):
        return None
    head, _, _random = name[: -len(TEMP_SUFFIX)].rpartition(".")
    final, _, tag = head.rpartition(".")
    if not final.endswith(SUFFIX) or len(tag) != _WRITER_TAG_HEX_DIGITS:
        return None
    try:
        int(tag, 16)
    except ValueError:
        return None
    return tag


# --- a tier directory's identity ---------------------------------------------------------------


class TierIdentity(NamedTuple):
    """What a tier directory says about itself (IDENTITY_FILE): which tier it is, the segment
    id it mounts as, the token that proves a reader found the right directory, (disk tier) its
    capacity, and (DFS) the cluster that uses it (auth.cluster_mark; "" in files written
    before 2026-12-05)."""

    tier: str
    segment_id: str
    token: bytes
    capacity_bytes: int
    owner: str = ""

    def encode(self) -> bytes:
        return json.dumps(
            {
                "tier": self.tier,
                "segment_id": self.segment_id,
                "token": self.token.hex(),
                "capacity_bytes": self.capacity_bytes,
                "owner": self.owner,
            }
        ).encode()


def decode_identity(data: bytes) -> TierIdentity | None:
    try:
        fields = json.loads(data)
        identity = TierIdentity(
            str(fields["tier"]),
            str(fields["segment_id"]),
            bytes.fromhex(fields["token"]),
            int(fields["capacity_bytes"]),
            str(fields.get("owner", "")),
        )
    except (ValueError, KeyError, TypeError):
        return None
    if not identity.segment_id or len(identity.token) != limits.SEGMENT_TOKEN_SIZE_BYTES:
        return None
    return identity
