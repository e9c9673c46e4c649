"""Every control message kvpool sends, as typed msgspec structs: the contract between processes.

A message is metadata only (keys, offsets, sizes, codes); object bytes never go through msgpack
but ride after it as the frame's raw payload (frames.py). Messages are encoded as msgpack arrays
with a small integer tag, which keeps batches of thousands of keys cheap to encode and decode.

Who sends what:

    client -> master   PutStart PutEnd PutRevoke GetReplicaList ExistKeys LongestPrefix
                       Remove RemoveByRegex RemoveAll QueryObjects ListObjects ClusterStatus
                       ReportBadReplicas ReleaseLeases
    node   -> master   MountSegment Heartbeat UnmountSegment DrainSegment
    master -> node     CommitObjects DropObjects MoveObjects VerifyObjects (on the node's own
                       connection)
    client -> node     WriteSlices (+ payload)  ReadSlices (reply + payload)
    server -> client   AuthChallenge, then client AuthResponse, server AuthOk (first frames)

Every request is answered by exactly one reply frame carrying the same request id: its typed
reply or an `ErrorReply(code, message)`. Batch replies carry one code per key.
"""

from __future__ import annotations

from typing import Annotated, TypeVar, Union

import msgspec

from kvpool import limits

T = TypeVar("T")
# A list a request carries one item of per key (BATCH_KEYS_MAX at most). The decoder refuses
# a longer one before it reads an item: a 64 MiB control message holds 22 million one-byte
# keys, whose decoding held a master's loop for seconds and took GiBs (any token holder could).
Batch = Annotated[list[T], msgspec.Meta(max_length=limits.BATCH_KEYS_MAX)]
# Replies are bounded as requests are: a frame with the reply flag is decoded before its
# receiver looks for a request waiting under its id, and a token holder's unasked
# PutStartReply of 24 million empty placement lists (24 MiB) held a master's loop for 11 s and
# took 1.7 GB. A list inside a list is bounded too, so that their product is. Each bound is
# what a legitimate answer may hold (below, and at the replies' fields).
#
# Replicas of one object in a reply (limits.REPLICAS_PER_OBJECT_MAX): a batch of keys with
# this many each decodes in well under a second (tests/test_protocol_frames.py).
Replicas = Annotated[list[T], msgspec.Meta(max_length=limits.REPLICAS_PER_OBJECT_MAX)]
# All a ClusterStatusReply lists, and more than a reply's segments name.
Segments = Annotated[list[T], msgspec.Meta(max_length=limits.SEGMENTS_MAX)]
SegmentsById = Annotated[dict[str, T], msgspec.Meta(max_length=limits.SEGMENTS_MAX)]
# A listing's keys (ListObjects.limit is at most this).
Listing = Annotated[list[T], msgspec.Meta(max_length=limits.LIST_OBJECTS_MAX)]


class Message(msgspec.Struct, array_like=True, tag_field="t", frozen=False):
    """Base of every message; never sent itself."""


# --- shared records -------------------------------------------------------------------------


# Structs that a batch carries one of per key (Replica, WriteItem, ReadItem) or holds
# while it lasts (WriteGrant, SegmentInfo) have gc=False: their fields are strs, ints, bytes
# and other such structs, so they can never be part of a reference cycle, and untracked they
# do not count towards the cyclic collector's next run. A client's zero-copy gets of 128 pages
# kept enough tracked objects alive to start a collection in most batches, whose survivors,
# promoted, brought a full collection of the whole heap every ~80 batches (client/transfer.py
# PutJob.copy_local has the figures).


class ReplicateConfig(msgspec.Struct, array_like=True):
    """How a put is placed: replica count, pins and placement strategy.

    Placement is one of "random" (default), "free_ratio" (emptiest segment first), "local"
    (segments on the client's host first) and "preferred" (the given segments first: DRAM
    segments, a disk or DFS one named there is skipped).
    """

    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    placement: str = "random"
    preferred_segments: Batch[str] = []
    # Appended with the tiers (docs/tiers.md); old encodings decode with the defaults.
    # with_disk_copy: put_end returns once a copy is also on the disk tier of the node that
    # holds the DRAM replica (write-through), or has failed: best effort, as replica_num is
    # (counted in the tier's failed_moves). with_dfs_copy: likewise on the shared filesystem.
    with_disk_copy: bool = False
    with_dfs_copy: bool = False


PLACEMENTS = ("random", "free_ratio", "local", "preferred")

# Where a replica lives (SegmentInfo.tier), fastest first: the order a get tries them in.
TIER_DRAM = "dram"
TIER_DISK = "disk"
TIER_DFS = "dfs"
TIERS = (TIER_DRAM, TIER_DISK, TIER_DFS)


class SegmentInfo(msgspec.Struct, array_like=True, gc=False):
    """A mounted segment as clients need to reach it.

    `endpoint` is the node's transfer server "host:port". `shm_path` is the segment file a
    same-host client may map ("" when the node turned the shm path off); `shm_token` is the
    random token written in that file's header, which proves the client mapped the right file.
    """

    segment_id: str
    node_id: str
    hostname: str
    endpoint: str
    shm_path: str
    shm_token: bytes
    capacity_bytes: int
    # Appended with the tiers (docs/tiers.md). "dram": a DRAM segment as above. "disk": a
    # node's disk tier, addressed like a segment (offset: where the master accounts the object
    # in the tier, which names its file); shm_path is its directory and shm_token the token
    # of its identity file. "dfs": the shared filesystem (one per cluster, no endpoint).
    tier: str = TIER_DRAM


class Replica(msgspec.Struct, array_like=True, gc=False):
    """Where one replica of an object lies: a byte range of a segment's data area."""

    segment_id: str
    offset: int


class WriteGrant(msgspec.Struct, array_like=True, gc=False):
    """The master's permission to write `size` bytes at `offset` of a segment until `expiry_ms`
    (wall clock). `term` names the master (a new one per start and per leadership term, see
    MountReply): a node takes only grants of the master it is mounted with now. `mac` is an
    HMAC of the other fields with the cluster key, empty without one."""

    segment_id: str
    offset: int
    size: int
    expiry_ms: int
    mac: bytes = b""
    term: int = 0


# InventoryEntry.pins: the object's pins as put, so that a master rebuilding from the nodes'
# inventories keeps them (a soft pin starts a fresh TTL then).
PIN_SOFT = 1
PIN_HARD = 2


class InventoryEntry(msgspec.Struct, array_like=True, gc=False):
    """One complete object held by a node: the node's own record, the truth the master rebuilds
    from. `pins` is PIN_SOFT, PIN_HARD or 0 (entries of a drop carry 0: drops match by key and
    offset).

    gc=False (fields of str and int only: never part of a reference cycle): 16 bytes less per
    entry, and a node's dict of entries by key is not tracked at all, so a full collection no
    longer visits it: 73-91 -> 42-71 ms with a million entries (`bench_paths.py node-commit`,
    `full_collection_ms_1M_entries`; the index's lists of entries are still visited)."""

    key: str
    offset: int
    size: int
    checksum: int
    pins: int = 0


class SegmentStatus(msgspec.Struct, array_like=True):
    """A segment as the master sees it. For a slower tier, what its node last reported of the
    filesystem under it: `filesystem_free_bytes` (-1: no report; a DRAM segment) and whether it
    takes writes (appended, with these defaults from an older master)."""

    segment: SegmentInfo
    state: str
    used_bytes: int
    object_count: int
    filesystem_free_bytes: int = -1
    is_writable: bool = True


class TierStatus(msgspec.Struct, array_like=True):
    """One tier across the cluster: its mounted segments' capacity and use, and what the
    master counted since it started. `object_count` counts replicas in the tier; `hits` gets
    whose nearest replica was in the tier; `offloads` objects moved into it from a faster
    tier; `promotions` objects copied into it from a slower tier (DRAM only); `evictions`
    replicas that left it to make room (moved down or dropped); `failed_moves` offloads,
    promotions and write-through copies into it that failed: the node could not write them,
    did not answer, or could not be reached (appended); `copies` write-through copies into it
    (with_disk_copy, with_dfs_copy: appended)."""

    tier: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    object_count: int = 0
    hits: int = 0
    offloads: int = 0
    promotions: int = 0
    evictions: int = 0
    failed_moves: int = 0
    copies: int = 0


# --- replies --------------------------------------------------------------------------------


class ErrorReply(Message, tag=1):
    code: int
    message: str = ""


class OkReply(Message, tag=2):
    pass


class CodesReply(Message, tag=3):
    """One `ErrorCode` per key of a batch request, in request order."""

    codes: Batch[int]


class CountReply(Message, tag=4):
    count: int


# --- authentication ---------------------------------------------------------------------------


class AuthChallenge(Message, tag=5):
    """First frame from any server. `required` is False when the server has no cluster token;
    `local_name` is the server's same-host Unix socket (transports/connection.py), if any;
    `local_host` (appended) where the server runs, which a client checks before it moves there
    (transports/same_host.py: "" from an older server, whose socket it does not take). With a
    token, the server's proof (AuthOk) covers every field (protocol/auth.py server_proof)."""

    nonce: bytes
    required: bool
    local_name: str = ""
    local_host: str = ""


class AuthResponse(Message, tag=6):
    nonce: bytes
    mac: bytes


class AuthOk(Message, tag=7):
    """The server's proof that it holds the token too (empty when auth is not required)."""

    mac: bytes


# --- client -> master -------------------------------------------------------------------------


class PutStart(Message, tag=10):
    """`put_id`: the writer's name for this put (random, client/store.py new_put_id), carried
    by its PutEnd and PutRevoke. They act only on keys whose put_start carried the same id:
    once a writer's put of a key is discarded (it stalled past the discard timeout) or lost
    with a master that failed over, the key may be another writer's put, which a late end or
    revoke by key alone would commit with the wrong checksum or take away."""

    keys: Batch[str]
    sizes: Batch[int]
    config: ReplicateConfig
    client_hostname: str = ""
    put_id: int = 0


class PutStartReply(Message, tag=11):
    """Per key: a code and where to write each replica, as (index into `grants`, offset of the
    key's bytes inside that grant's range). Keys of one request share grants: the master
    allocates a run of keys as one range per replica (master/puts.py). OBJECT_ALREADY_EXISTS
    means the object is complete already: nothing to write, and the put counts as done."""

    codes: Batch[int]
    # One (grant, offset) per replica: replica_num of them at most.
    placements: Batch[Annotated[list[tuple[int, int]], msgspec.Meta(max_length=limits.REPLICA_NUM_MAX)]]
    # One per run of keys and replica: a run per key at most.
    grants: Annotated[list[WriteGrant], msgspec.Meta(max_length=limits.BATCH_KEYS_MAX * limits.REPLICA_NUM_MAX)]
    segments: SegmentsById[SegmentInfo]
    # How long the grants last from the put_start (the master's put_discard_timeout_ms): a
    # writer ends its writes well within it, so that what it wrote can still be put_end'ed.
    # Appended: 0 from an older master.
    grant_ttl_ms: int = 0

    def replicas_of(self, index: int) -> list[tuple[WriteGrant, int]]:
        """Key `index`'s replicas: (the grant covering it, its offset inside the grant)."""
        return [(self.grants[g], start) for g, start in self.placements[index]]


class PutEnd(Message, tag=12):
    """`hashed_in_place`: the segments this writer copied every key of the batch into through
    its mapping (same host), hashing the bytes where they landed (checksums.copy_checksummed).
    Their nodes record those commits without hashing the bytes again: a copy through a mapping
    cannot land in part, so the second hash would only repeat the first (readers verify every
    read regardless). A writer over TCP lists nothing: a write that broke off mid-way is
    refused by the node's hash.

    `unwritten`: (index into `keys`, segment id) of each replica whose write failed or broke
    off (its node timed out or closed mid-frame) while the key's other replicas were written.
    The master commits the key without them, so a reader is never sent to a replica the writer
    knows is partial; their ranges stay quarantined as a revoked write's (it may land yet).
    Since wire version 11; a list cut at BATCH_KEYS_MAX leaves the rest to the nodes' hashes."""

    keys: Batch[str]
    checksums: Batch[int]
    hashed_in_place: Batch[str] = []
    put_id: int = 0  # the PutStart's (the pieces of one put share it)
    unwritten: Batch[tuple[int, str]] = []


class PutRevoke(Message, tag=13):
    """The writer gave up these keys' puts. `writes_in_flight`: some of its writes to nodes
    may still land (it stopped waiting for them: a cancelled or timed-out call), so the keys are
    free at once but their ranges stay quarantined until the nodes take no more of them (the
    grants' expiry and a margin: master/puts.py revoke); else every range is free at once. Its
    writes into mapped segments (same host) must be over before it is sent."""

    keys: Batch[str]
    writes_in_flight: bool = False
    put_id: int = 0  # the PutStart's


class GetReplicaList(Message, tag=14):
    keys: Batch[str]


class GetReplicaListReply(Message, tag=15):
    """Per key: a code, the size, checksum and replicas (nearest first is the client's choice).
    Every found object is under a read lease of `lease_ttl_ms` from the master's reply, granted
    at `lease_granted_ms` (the master's clock): a reader that is done gives it back with that
    time (ReleaseLeases)."""

    codes: Batch[int]
    sizes: Batch[int]
    checksums: Batch[int]
    replicas: Batch[Replicas[Replica]]
    lease_ttl_ms: int
    segments: SegmentsById[SegmentInfo]
    lease_granted_ms: int = 0


class ReleaseLeases(Message, tag=29):
    """client -> master: these readers are done: the leases granted at `granted_ms[i]` (as
    GetReplicaListReply said) on the `counts[i]` keys that follow in `keys` are given back. An
    object's lease ends when its last reader gives it back, or at its expiry, whichever comes
    first. Answered with OkReply. One flat list of keys (wire version 8): a list of lists, each
    bounded, let one frame carry 15 million keys, decoded on the master's loop before anything
    looked at them (6-7 s and 1.2 GB)."""

    granted_ms: Batch[int]
    counts: Batch[int]
    keys: Batch[str]


class ExistKeys(Message, tag=16):
    keys: Batch[str]


class ExistsReply(Message, tag=17):
    flags: Batch[bool]


class LongestPrefix(Message, tag=18):
    """How many leading keys are complete objects. With `hold_ms` > 0 (at most the master's
    lease TTL; more is cut to it), each of those objects is kept from eviction for that long
    or until `hold_reads` reads of it have begun and their readers have given their leases
    back (ReleaseLeases), whichever comes first: an engine's lookup holds what it found until
    its load reads it, and an object that several ranks load (the TP ranks of an MLA model
    share one) until the last of them has. Answered with CountReply."""

    keys: Batch[str]
    hold_ms: int = 0
    hold_reads: int = 1


class Remove(Message, tag=19):
    keys: Batch[str]
    force: bool = False


class RemoveByRegex(Message, tag=20):
    pattern: str
    force: bool = False


class RemoveAll(Message, tag=21):
    force: bool = False


class QueryObjects(Message, tag=22):
    """Sizes and replicas without a lease (get_size, stat)."""

    keys: Batch[str]


class QueryReply(Message, tag=23):
    codes: Batch[int]
    sizes: Batch[int]
    replicas: Batch[Replicas[Replica]]


class ListObjects(Message, tag=24):
    pattern: str = ""
    limit: int = 1000


class ListReply(Message, tag=25):
    keys: Listing[str]
    sizes: Listing[int]
    truncated: bool


class ReportBadReplicas(Message, tag=28):
    """client -> master: these replicas' bytes did not match their object's checksum when read
    (`segment_ids[i]`, `offsets[i]` of `keys[i]`). The master asks each node to hash them
    (VerifyObjects) and drops the objects whose node agrees; a client's word alone changes
    nothing. Answered at once (OkReply): the check runs after."""

    keys: Batch[str]
    segment_ids: Batch[str]
    offsets: Batch[int]


class ClusterStatus(Message, tag=26):
    pass


class ClusterStatusReply(Message, tag=27):
    segments: Segments[SegmentStatus]
    object_count: int
    pending_count: int
    evicted_count: int
    # One per tier; appended with the tiers, empty from an older master.
    tiers: Annotated[list[TierStatus], msgspec.Meta(max_length=len(TIERS))] = []
    # Appended: the master's --evict-watermark-high (eviction starts above it, segment by
    # segment; kvpool bench plans below it); 0.0 from an older master.
    evict_watermark_high: float = 0.0

    def segment_infos(self) -> dict[str, SegmentInfo]:
        """The mounted segments by id: where a replica named by its segment id lies."""
        return {status.segment.segment_id: status.segment for status in self.segments}

    def to_dict(self) -> dict:
        """A JSON-ready view with named fields (the wire form is positional)."""
        return {
            "object_count": self.object_count,
            "pending_count": self.pending_count,
            "evicted_count": self.evicted_count,
            "evict_watermark_high": self.evict_watermark_high,
            "tiers": [msgspec.structs.asdict(t) for t in self.tiers],
            "segments": [
                {
                    "segment_id": s.segment.segment_id,
                    "node_id": s.segment.node_id,
                    "hostname": s.segment.hostname,
                    "endpoint": s.segment.endpoint,
                    "tier": s.segment.tier,
                    "state": s.state,
                    "capacity_bytes": s.segment.capacity_bytes,
                    "used_bytes": s.used_bytes,
                    "object_count": s.object_count,
                    "filesystem_free_bytes": s.filesystem_free_bytes,
                    "writable": s.is_writable,
                }
                for s in self.segments
            ],
        }


# --- node <-> master --------------------------------------------------------------------------


class MountSegment(Message, tag=40):
    """Mount (or re-mount after a master restart) a segment with the objects it already holds.
    A large inventory comes in several, in order; the master places nothing on the segment
    until the last (`is_last`): a range not yet reported may still hold an object. It refuses
    a part after the first (`is_first` False) unless the segment is mounting since a first
    part: the segment went between them (timed out), and the node mounts again from the first."""

    segment: SegmentInfo
    inventory: Batch[InventoryEntry]
    is_last: bool = True
    is_first: bool = True


class MountReply(Message, tag=41):
    """`rejected` lists inventory entries the master refused (overlap, conflict): drop them.
    `term` names this master; the node refuses write grants of any other (0: none).
    `master_time_ms` is the master's wall clock as it answered (0: not said), which the node
    checks grant expiries against (node/clock.py)."""

    rejected: Batch[InventoryEntry]  # (of the MountSegment's inventory)
    term: int = 0
    master_time_ms: int = 0


class FilesystemReport(msgspec.Struct, array_like=True, gc=False):
    """What the filesystem under a slower-tier segment can take, as its node saw it: the
    `free_bytes` left there, on `device` (its device number on the node's host, which the disk
    tiers of nodes sharing one disk share; -1: not known), or nothing (`is_writable` false:
    read-only, its directory cannot be read, or a look at it is overdue: a disk that hangs)."""

    free_bytes: int = 0
    device: int = -1
    is_writable: bool = True


class Heartbeat(Message, tag=42):
    """node -> master, every heartbeat interval. `filesystems`: by segment id, what the
    filesystems under the node's slower tiers can take, which caps the room the master gives
    them (master/tiers.py report_free, report_writable); appended, empty from an older node."""

    segment_ids: Batch[str]
    filesystems: Annotated[dict[str, FilesystemReport], msgspec.Meta(max_length=limits.BATCH_KEYS_MAX)] = {}


class HeartbeatReply(Message, tag=43):
    """Segments the master does not know (it restarted): the node re-mounts them. And the
    master's wall clock as it answered (0: not said; MountReply)."""

    unknown_segment_ids: Batch[str]  # (of the Heartbeat's)
    master_time_ms: int = 0


class UnmountSegment(Message, tag=44):
    """A node takes its segment away. `is_kept`: it keeps the segment's objects for its next
    start (a DRAM segment its node stops with --keep-ms), which mounts it again."""

    segment_id: str
    is_kept: bool = False


class DrainSegment(Message, tag=45):
    """Stop new allocations on a segment; unmount it after `timeout_ms` (readable till then).
    `is_kept`: its node keeps the segment for its restart (UnmountSegment.is_kept), should the
    drain's end come before the node's own unmount."""

    segment_id: str
    timeout_ms: int
    is_kept: bool = False


class CommitObjects(Message, tag=46):
    """master -> node at put_end: record these complete objects in the inventory. The node
    verifies size and checksum against its bytes first, unless `is_hashed_in_place` (the
    writer hashed them in this segment: PutEnd.hashed_in_place); the reply has one code per
    entry."""

    segment_id: str
    entries: Batch[InventoryEntry]
    is_hashed_in_place: bool = False


class VerifyObjects(Message, tag=49):
    """master -> node: hash these objects' bytes (matched by key and offset in the inventory of
    the DRAM segment or the disk tier `segment_id` names); one code per entry: OK,
    TRANSFER_FAIL (the bytes do not hash to the committed checksum; for a disk file also gone,
    torn or unreadable) or OBJECT_NOT_FOUND (not held here, or held elsewhere in the segment)."""

    segment_id: str
    entries: Batch[InventoryEntry]


class DropObjects(Message, tag=47):
    """master -> node before a range is reused: forget these objects (by key and offset)."""

    segment_id: str
    entries: Batch[InventoryEntry]


class MoveItem(msgspec.Struct, array_like=True):
    """Copy one object from a replica to a range the master allocated in another tier.

    The source is a replica the node holds (its DRAM segment or disk tier) or the shared
    filesystem; the destination is the node's DRAM segment, its disk tier, or the shared
    filesystem. The node records the destination in that tier's inventory once the copy is
    complete (and durable, for a file), and never changes the source: the master drops it
    afterwards when the move was an offload.
    """

    key: str
    size: int
    checksum: int
    src_segment_id: str
    src_offset: int
    dst_segment_id: str
    dst_offset: int


class MoveObjects(Message, tag=48):
    """master -> node: copy objects between tiers (offload, promotion, write-through). The
    reply is a CodesReply with one code per item: OK, OBJECT_NOT_FOUND (the source is gone or
    corrupt: forget it), or another code (the copy failed; nothing was recorded).

    A copy not finished by `deadline_ms` (the master's clock; 0: none) is not recorded, and
    what it wrote is removed: the master gives up on the request a little later and drops its
    targets (limits.MOVE_DECIDED_BEFORE_TIMEOUT_MS)."""

    items: Batch[MoveItem]
    deadline_ms: int = 0


# --- client <-> node --------------------------------------------------------------------------


class WriteItem(msgspec.Struct, array_like=True, gc=False):
    """Write `size` payload bytes at `grant.offset + start`; the range must lie inside the grant."""

    grant: WriteGrant
    start: int
    size: int


class WriteSlices(Message, tag=60):
    """The frame's payload is the items' bytes, concatenated in item order."""

    items: Batch[WriteItem]


class ReadItem(msgspec.Struct, array_like=True, gc=False):
    segment_id: str
    offset: int
    size: int


class ReadSlices(Message, tag=61):
    """The reply's payload is the items' bytes, concatenated in item order. `landing`: where
    the reader's buffer for them starts, modulo 4 KiB (-1: not said), which the node's reply
    pads its control message for (frames.payload_padding)."""

    items: Batch[ReadItem]
    landing: int = -1

    @property
    def landing_offset(self) -> int | None:
        """`landing`, or None when the reader did not say."""
        return None if self.landing < 0 else self.landing


class ReadReply(Message, tag=62):
    """The frame's payload is the requested ranges, concatenated in item order."""

    size: int


AnyMessage = Union[
    ErrorReply,
    OkReply,
    CodesReply,
    CountReply,
    AuthChallenge,
    AuthResponse,
    AuthOk,
    PutStart,
    PutStartReply,
    PutEnd,
    PutRevoke,
    GetReplicaList,
    GetReplicaListReply,
    ExistKeys,
    ExistsReply,
    LongestPrefix,
    Remove,
    RemoveByRegex,
    RemoveAll,
    QueryObjects,
    QueryReply,
    ListObjects,
    ListReply,
    ClusterStatus,
    ClusterStatusReply,
    MountSegment,
    MountReply,
    Heartbeat,
    HeartbeatReply,
    UnmountSegment,
    DrainSegment,
    CommitObjects,
    DropObjects,
    MoveObjects,
    VerifyObjects,
    ReportBadReplicas,
    ReleaseLeases,
    WriteSlices,
    ReadSlices,
    ReadReply,
]

REPLY_TYPES = (
    ErrorReply,
    OkReply,
    CodesReply,
    CountReply,
    PutStartReply,
    GetReplicaListReply,
    ExistsReply,
    QueryReply,
    ListReply,
    ClusterStatusReply,
    MountReply,
    HeartbeatReply,
    ReadReply,
)
