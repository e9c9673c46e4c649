"""Every bound and default of kvpool, in one place.

Each queue, batch, buffer, retry loop and wait has a `_MAX` here, and every default that an
operator may override has a `_DEFAULT`. Time is an `int` in milliseconds. The import-time asserts
keep the numbers consistent with one another. Nothing here reads the environment: config.py does.
"""

from __future__ import annotations

import struct

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# --- wire format -----------------------------------------------------------------------------
# Frame header: magic u16, version u8, flags u8, request_id u32, control_size u32, payload_size u64.
FRAME_HEADER_FMT = "<HBBIIQ"
FRAME_HEADER_SIZE_BYTES = 20
FRAME_MAGIC = 0x4B50  # "PK" little-endian: kvpool.
# 2: padded control messages (frames.FLAG_PADDED). 3: ReleaseLeases, and the grant time in
# GetReplicaListReply (a master of version 2 would close a client's connection at its first
# release). Peers of different versions part at the handshake's first frame, with the reason
# logged, rather than later, mid-request. 4: put ids (PutStart, PutEnd and PutRevoke). 5: the
# lookup hold (LongestPrefix.hold_ms, which a master of version 4 would drop unread). 6: a
# move's deadline (MoveObjects.deadline_ms: a node of version 5 would record a move the master
# gave up on) and a mount's last part (MountSegment.is_last). 7: the reads a lookup holds for
# (LongestPrefix.hold_reads: a master of version 6 would end an MLA block's hold at the first
# of the TP ranks that read it). 8: ReleaseLeases' keys in one bounded list with a count per
# grant time (its list of lists let one frame hold 15 million keys). 9: frames after a handshake
# with a token carry a tag (frames.FLAG_SEALED), and their payloads one more: a peer of version 8
# sends none, and is refused. 10: the server's proof covers its challenge's fields
# (auth.server_proof: whether it requires a token, its same-host socket), and a client without
# a token answers the challenge (its server logs the refusal). 11: the replicas a writer knows
# are partial (PutEnd.unwritten: a master of version 10 would publish them unread). 12: a DRAM
# segment unmounted to be mounted again (UnmountSegment.is_kept: a master of version 11 would
# forget what was removed meanwhile, and the node's restart bring it back).
FRAME_VERSION = 12
# The tag that ends a sealed frame's control message (frames.FrameSeal), and the one that
# follows its payload, if any (Poly1305): 128 bits each.
FRAME_TAG_SIZE_BYTES = 16
PAYLOAD_TAG_SIZE_BYTES = 16
# A control message is metadata only (keys, offsets, codes); 72 MiB holds a batch of 16,384
# maximal keys with what each carries (asserted below: 64 MiB was the keys alone, and such a
# batch failed with LocalProtocolError), and bounds what a malicious peer can make us buffer.
FRAME_CONTROL_SIZE_BYTES_MAX = 72 * MIB
# A payload rides in one frame up to this size; larger transfers are cut into slices.
SLICE_SIZE_BYTES_MAX = 64 * MIB
FRAME_PAYLOAD_SIZE_BYTES_MAX = 1 * GIB
REQUEST_ID_MAX = 2**32 - 1

# --- objects and keys ------------------------------------------------------------------------
KEY_SIZE_BYTES_MAX = 4 * KIB
OBJECT_SIZE_BYTES_MAX = 1 * GIB
BATCH_KEYS_MAX = 16_384
# Keys a remove_all or remove_by_regex looks at between two turns of the master's loop (about
# 30 ms of it at 2 us a removal: master/service.py Removal).
REMOVE_STEP_KEYS = 16_384
# Disk items one ReadSlices may name: what a client's frame holds at most (one item per key,
# BATCH_KEYS_MAX keys: client/transfer.py). Each object file a frame names is open until the
# frame is sent (one descriptor per file, shared by its items: DiskTier.open_range).
DISK_ITEMS_PER_FRAME_MAX = BATCH_KEYS_MAX
REPLICA_NUM_MAX = 8
# Replicas one object may have: a put places at most REPLICA_NUM_MAX, write-through and
# offloads add disk and DFS copies, and a master rebuilding from its nodes' inventories adopts
# one copy per segment up to this (master/mounts.py adopt: the rest are refused, their nodes
# drop them); what a reply lists per key (protocol/messages.py Replicas).
REPLICAS_PER_OBJECT_MAX = 64
# Segments a master mounts at once (a segment's index is 16 bits in a packed replica,
# master/metadata.py): all a ClusterStatusReply lists.
SEGMENTS_MAX = 1 << 16
REGEX_SIZE_BYTES_MAX = 4 * KIB
LIST_OBJECTS_MAX = 100_000
# A listing ends (truncated) once its keys hold this many bytes: 100,000 long keys would not fit
# one reply frame.
LIST_OBJECTS_KEY_BYTES_MAX = 32 * MIB

# --- allocation ------------------------------------------------------------------------------
# Every allocation starts on a cache line, so that copies into a segment never straddle one
# needlessly. KV-cache slices are multiples of kilobytes, so the waste is nil in practice.
ALLOCATION_ALIGN_BYTES = 64
SEGMENT_SIZE_BYTES_MIN = 1 * MIB
# A DRAM segment, a node's disk tier or the cluster's DFS tier: 128 TiB each (disk and DFS
# object file names spell offsets in 12 hex digits, protocol/objectfile.py).
SEGMENT_SIZE_BYTES_MAX = 128 * 1024 * GIB
# The segment file starts with one page of header (magic, token, capacity); data follows.
SEGMENT_HEADER_SIZE_BYTES = 4 * KIB
SEGMENT_TOKEN_SIZE_BYTES = 16
PAGE_SIZE_BYTES = 4 * KIB
# A client maps same-host segments up to this size with their page tables filled at once;
# larger ones fault in lazily (page tables for 8 GiB of 4 KiB pages take 16 MiB).
SHM_POPULATE_SIZE_BYTES_MAX = 8 * GIB

# --- leases, puts, eviction (Mooncake's defaults where they exist) ----------------------------
LEASE_TTL_MS_DEFAULT = 10_000  # Mooncake default_kv_lease_ttl: 10 s.
SOFT_PIN_TTL_MS_DEFAULT = 30 * 60_000
# What an engine adapter's prefix lookup holds from eviction, for the load that follows it (a
# scheduler step or a few later, on its workers); the load's lease release ends it sooner, the
# master cuts it to its lease TTL (LongestPrefix.hold_ms).
LOOKUP_HOLD_MS_DEFAULT = 5_000
# An adapter's lookup_hold_ms above this is refused at start as a typo (an hour; the master
# would cut it to the lease TTL anyway).
LOOKUP_HOLD_MS_MAX = 3_600_000
# How long a bulk removal waits for the master (an engine adapter's removal of a model's
# objects: vLLM's reset of the connector's cache, SGLang's clear; `kvpool rm --regex/--all`):
# it removes about 6 us an object on this project's machine (ad hoc, 200k objects through the
# pure service), so 5 minutes is some 50 million, where the RPC timeout is under a million.
BULK_REMOVE_TIMEOUT_MS = 300_000
# A call's own bound (remove_all/remove_by_regex `timeout_ms`) above this is refused: a week,
# removals of some 100 billion objects, far more than a master holds. Unbounded, 2**53 ms passed
# the client's check and the sync Store's wait for it raised OverflowError (threading.TIMEOUT_MAX).
CALL_TIMEOUT_MS_MAX = 7 * 24 * 3_600_000
assert BULK_REMOVE_TIMEOUT_MS <= CALL_TIMEOUT_MS_MAX
# The reads one lookup may hold its hits for (LongestPrefix.hold_reads: the engine ranks that
# load each object, at most a TP group's).
LOOKUP_HOLD_READS_MAX = 1_024
# A writer silent past the discard timeout loses its put (the key becomes free again); its
# space is released only after the release timeout, so a slow writer can never scribble on
# someone else's object (Mooncake put_start_discard_timeout_sec=30, release_timeout_sec=600).
PUT_DISCARD_TIMEOUT_MS_DEFAULT = 30_000
PUT_RELEASE_TIMEOUT_MS_DEFAULT = 600_000
# A put revoked with writes to other hosts in flight holds its ranges until its grants expire
# plus this, not the release timeout: those writes go through nodes, which take no byte past a
# grant's expiry by the master's clock (node/clock.py errs early) and close the connection then;
# this covers a node's loop stalled past that moment with bytes already in its socket, which
# land before the timer that closes it runs, and a step forward of the master's wall clock of
# up to as much (its nodes see it at their next heartbeat). (A same-host writer copies into the mapped segment
# itself, and nothing stops one that stalled mid-copy: a discarded put keeps the release timeout.)
REVOKED_WRITES_FENCE_MARGIN_MS = 30_000
# A master whose tokens were replaced (auth.Keyring) marks etcd and the DFS with its first
# token's mark, trying again this often until it has: a master restarted with that token alone
# would otherwise find the cluster's marks another token's, and refuse to stand or to start.
CLUSTER_MARK_RETRY_MS = 5_000
EVICT_WATERMARK_RATIO_HIGH_DEFAULT = 0.90
EVICT_RATIO_DEFAULT = 0.05

# --- membership ------------------------------------------------------------------------------
NODE_TTL_MS_DEFAULT = 10_000
HEARTBEAT_INTERVAL_MS_DEFAULT = 1_000
# A heartbeat waits this long at most for the look at its disk tier's filesystem (a statvfs):
# a disk that stops answering must not silence the node (node/server.py _filesystems).
FILESYSTEM_LOOK_WAIT_MS = 500
# ... and a look overdue this long reports the tier as taking no writes (no more moves there).
FILESYSTEM_LOOK_OVERDUE_MS = 5_000
DRAIN_TIMEOUT_MS_DEFAULT = 30_000
# A TTL, timeout or interval setting (MasterConfig, NodeConfig, ClientConfig) above this is
# refused at start: a week, longer than any of them means. Unbounded, `--lease-ttl-ms` 1e20
# started, then every get's reply (its lease TTL, past a u64) failed to encode and
# closed the client's connection.
SETTING_DURATION_MS_MAX = 7 * 24 * 3_600_000
# `kvpool node --drain-ms`: a drain is for readers to move on, not a second way to keep a node.
DRAIN_TIMEOUT_MS_MAX = 3_600_000
# A master restarted with no memory waits this long for nodes to re-mount before it treats an
# absent node as gone; during the wait it serves what it knows.
REMOUNT_GRACE_MS_DEFAULT = 3_000
# A node's mount in parts that the master refuses past the first (the segment timed out
# between parts) starts again from its first segment's first part, at most this many times on
# one link; past them the link closes and the node mounts again on a new one.
MOUNT_RESTARTS_MAX = 3
# A segment that holds objects leaves in steps (master/mounts.py) when the table holds more
# keys than one step looks at (a few ms of work) before the master serves requests again.
UNMOUNT_SWEEP_KEYS_PER_STEP = 20_000
# Drops a segment left with, unacknowledged (master/tombstones.py): kept this long for its node
# to come back (a day covers a node's repair; a DRAM segment comes back only from a node cut
# off, which mounts again as soon as it reaches the master, or one restarted with its segment
# kept, KEEP_MS_MAX below), and at most this many (~100 bytes
# each).
TOMBSTONE_TTL_MS = 24 * 3_600_000
TOMBSTONE_DRAM_TTL_MS = 10 * 60_000
TOMBSTONES_MAX = 1_000_000
# A node stopped with --keep-ms leaves its DRAM segment for its restart at most this long
# (node/segment.py): what was removed meanwhile is refused when it comes back only while the
# master keeps the segment's tombstones, and the two clocks may differ by a minute or more.
KEEP_MS_MAX = 5 * 60_000
assert KEEP_MS_MAX < TOMBSTONE_DRAM_TTL_MS
# Keys of objects lost with a segment that went (it held their only replica; a remove meanwhile
# makes them tombstones): a budget of their own, so that a node timed out with a disk tier of a
# million objects pushes out neither the replicas left behind nor the drops' tombstones above. As
# large: one full disk tier is the case it is for, and a smaller one would forget part of it.
LOST_KEYS_MAX = 1_000_000

# --- client and connections -------------------------------------------------------------------
MASTER_PORT_DEFAULT = 50051
# A server given port 0 on a host of several addresses (localhost: 127.0.0.1 and ::1) binds the
# others to the port the first got; where one of them holds it already, it picks again, this
# many times at most (transports/connection.py bind_listening_sockets).
LISTEN_PORT_PICKS_MAX = 8
MASTER_HTTP_PORT_DEFAULT = 9100
RPC_TIMEOUT_MS_DEFAULT = 5_000
CONNECT_TIMEOUT_MS_DEFAULT = 2_000
TRANSFER_TIMEOUT_MS_DEFAULT = 30_000
# A frame's header and control message must all come within this of their first byte: a peer
# that sends part of a large one (up to FRAME_CONTROL_SIZE_BYTES_MAX) and stalls would hold that
# memory until it hung up. (A payload lands in its sinks and holds no buffer of its own.)
FRAME_RECEIVE_TIMEOUT_MS = TRANSFER_TIMEOUT_MS_DEFAULT
CONNECTIONS_PER_PEER_DEFAULT = 4
# How long a master's or node's loop keeps polling after each reply before it sleeps
# (transports/busy_poll.py): a client's next request then finds it awake.
BUSY_POLL_US_DEFAULT = 200
BUSY_POLL_US_MAX = 10_000
# ... except after granting a put or locating a get of at least this many bytes: the client
# then copies for longer than the window (4 MiB at memory speed: 0.4 ms or more).
BUSY_POLL_HOLD_OFF_BYTES = 4 * MIB
CONNECTIONS_PER_PEER_MAX = 64
RPC_RETRY_COUNT_MAX = 3
INFLIGHT_REQUESTS_PER_CONNECTION_MAX = 4_096
RECONNECT_BACKOFF_MS_MAX = 2_000
AUTH_NONCE_SIZE_BYTES = 32
AUTH_TIMEOUT_MS = 2_000
# A server's connections in their handshake at once (TCP and Unix together); past it the oldest
# is closed (transports/connection.py `_begin_handshake`).
HANDSHAKES_PENDING_MAX = 256
# A server whose open files pass this share of its limit says so in its log: past the limit the
# kernel's queue of new connections is closed as it comes, without a word to either side
# (libuv's answer to EMFILE), and a client only sees "connection closed by peer".
OPEN_FILES_WARN_RATIO = 0.9
# The HTTP ports (/metrics, /health, /status: transports/http.py) take no token, and the
# RPC's bound does not count their connections: before, 1,070 connections that each sent half a
# request's head and stalled held 1,008 of a master's 1,024 descriptors, and no client nor node
# could connect for as long as they stayed. A port holds this many at once (a monitoring
# system's scrapes, a few at a time and a few ms each; past it a newcomer is closed as it
# comes): well within the quarter of its open files a server keeps out of its connections'
# share (256 of 1,024, connection.py authenticated_connections_max).
HTTP_CONNECTIONS_MAX = 64
# ... closes a connection whose first request's head has not all come this long after it
# opened (a scraper sends it in one packet) ...
HTTP_REQUEST_HEAD_TIMEOUT_MS = 5_000
# ... and one idle between requests, or in the middle of a later request's head, this long
# (aiohttp's keepalive_timeout, an hour by default; a scrape every 15 s opens a new one).
HTTP_KEEPALIVE_TIMEOUT_MS = 5_000
REGISTERED_BUFFERS_MAX = 65_536
# Operations of one kind an engine adapter keeps for the engine's stats until the engine takes
# them (vLLM does after every step: integrations/vllm_stats.py); past it they are not kept.
ENGINE_STATS_RECORDS_MAX = 10_000

assert FRAME_HEADER_SIZE_BYTES == struct.calcsize(FRAME_HEADER_FMT)
assert SLICE_SIZE_BYTES_MAX % PAGE_SIZE_BYTES == 0
assert SLICE_SIZE_BYTES_MAX <= FRAME_PAYLOAD_SIZE_BYTES_MAX
assert OBJECT_SIZE_BYTES_MAX <= FRAME_PAYLOAD_SIZE_BYTES_MAX
assert SEGMENT_HEADER_SIZE_BYTES % PAGE_SIZE_BYTES == 0
assert SEGMENT_HEADER_SIZE_BYTES % ALLOCATION_ALIGN_BYTES == 0
assert PUT_DISCARD_TIMEOUT_MS_DEFAULT < PUT_RELEASE_TIMEOUT_MS_DEFAULT
assert HEARTBEAT_INTERVAL_MS_DEFAULT * 3 <= NODE_TTL_MS_DEFAULT
assert (HEARTBEAT_INTERVAL_MS_DEFAULT + FILESYSTEM_LOOK_WAIT_MS) * 3 <= NODE_TTL_MS_DEFAULT
assert 0.0 < EVICT_RATIO_DEFAULT < EVICT_WATERMARK_RATIO_HIGH_DEFAULT <= 1.0
assert CONNECTIONS_PER_PEER_DEFAULT <= CONNECTIONS_PER_PEER_MAX
assert HTTP_CONNECTIONS_MAX <= 1_024 // 4  # within the quarter a server of 1,024 open files keeps
# A batch of maximal keys, each with up to 64 bytes of what its request or reply adds (a size,
# a code, a str header), fits one control message with a MiB to spare.
assert BATCH_KEYS_MAX * (KEY_SIZE_BYTES_MAX + 64) <= FRAME_CONTROL_SIZE_BYTES_MAX - MIB
assert LIST_OBJECTS_KEY_BYTES_MAX + LIST_OBJECTS_MAX * 64 <= FRAME_CONTROL_SIZE_BYTES_MAX - MIB

# --- high availability: etcd election and discovery (master/election.py, discovery.py) -----
# The leader's etcd lease (Mooncake's ETCD_MASTER_VIEW_LEASE_TTL = 5 s, types.h). etcd counts
# lease TTLs in whole seconds.
ETCD_LEASE_TTL_MS_DEFAULT = 5_000
# A leader stops answering this long before its lease can lapse at etcd, measured from when
# it *sent* its last successful keepalive (etcd renewed later than that, never earlier). It
# covers the drift between the leader's clock and etcd's over one TTL (ppm: nil) and the
# delay between a request's leadership check and its effect (one loop turn; a stalled loop
# is caught by the check itself, which reads the clock). A lost keepalive is retried every
# third of a TTL, so a leader that cannot reach etcd steps down TTL - margin after the last
# renewal that worked: 4 s with the defaults.
LEADER_STEP_DOWN_MARGIN_MS_DEFAULT = 1_000
ETCD_KEEPALIVES_PER_TTL = 3
# One etcd request (range, txn, lease grant/keepalive/revoke), per endpoint tried.
ETCD_REQUEST_TIMEOUT_MS = 1_000
ETCD_ENDPOINTS_MAX = 16
# What kvpool ever reads back from etcd is a leader record or a segment list.
ETCD_RESPONSE_SIZE_BYTES_MAX = 4 * MIB
# A standby's watch of the leader key is re-armed after this, re-checking the key even if a
# watch event was lost (a compacted revision, a restarted etcd).
ETCD_WATCH_TIMEOUT_MS = 10_000
# Retry delay of a candidate whose etcd is unreachable, doubling from 100 ms.
ELECTION_RETRY_BACKOFF_MS_MAX = 1_000
# The segment ids a leader records for its successor (one etcd value: well under etcd's
# default 1.5 MiB request limit at ~30 bytes an id).
LEADER_RECORD_SEGMENTS_MAX = 16_384
CLUSTER_ID_SIZE_BYTES_MAX = 128
# A segment's node id, hostname, endpoint and path (SegmentInfo): names, not payloads.
SEGMENT_NAME_SIZE_BYTES_MAX = 4096
CLUSTER_ID_DEFAULT = "default"
# A client call that meets no leader (failover in progress) re-resolves and retries at most
# this often within its own bound (connect + RPC timeout), backing off up to the max below.
MASTER_CALL_ATTEMPTS_MAX = 32
MASTER_RESOLVE_BACKOFF_MS_MIN = 50
MASTER_RESOLVE_BACKOFF_MS_MAX = 500
# A retry starts only with at least this much of the call's bound left: a lookup squeezed into
# the last milliseconds would time out and hide the real answer (NotLeader, say).
MASTER_ATTEMPT_MS_MIN = 50
# Checks of replicas readers found bad (ReportBadReplicas) the master runs at a time.
VERIFY_TASKS_MAX = 8

assert ETCD_LEASE_TTL_MS_DEFAULT % 1_000 == 0
assert 2 * LEADER_STEP_DOWN_MARGIN_MS_DEFAULT < ETCD_LEASE_TTL_MS_DEFAULT
# Two keepalives may fail before the leader steps down.
assert ETCD_LEASE_TTL_MS_DEFAULT // ETCD_KEEPALIVES_PER_TTL * 2 < (
    ETCD_LEASE_TTL_MS_DEFAULT - LEADER_STEP_DOWN_MARGIN_MS_DEFAULT
)
assert MASTER_RESOLVE_BACKOFF_MS_MIN <= MASTER_RESOLVE_BACKOFF_MS_MAX <= RECONNECT_BACKOFF_MS_MAX

# --- tiers: the node disk tier and the shared filesystem (docs/tiers.md) ----------------------
# A node copies between its tiers (offload, promotion, write-through) on this many threads.
DISK_IO_THREADS = 4
# Bytes of moves a node admits at once; a MoveObjects beyond it waits (bounded) for room.
MOVE_QUEUE_BYTES_MAX = 512 * MIB
# The master keeps at most this many bytes of offloads and promotions in flight per node, so
# a slow disk holds DRAM full (puts wait, then fail cleanly) instead of queueing without end.
MOVE_INFLIGHT_BYTES_PER_NODE_MAX = 256 * MIB
MOVE_ITEMS_PER_REQUEST_MAX = 1_024
# The master sends a node its drops in requests of at most this many entries, and serves other
# requests between them: one DropObjects of a remove_by_regex's 6,144 objects held a put's
# commit, queued behind it on the same connection, for 50-150 ms (the node forgetting them,
# the master freeing their ranges); a chunk takes 1-3 ms at either end.
DROP_ENTRIES_PER_REQUEST_MAX = 512
# One MoveObjects round trip: its copies, their fsyncs, and the wait for admission.
MOVE_TIMEOUT_MS = 60_000
# A node decides a move (records its targets, or gives them up) at least this long before the
# master stops waiting for the answer (MoveObjects.deadline_ms): a move the master gave up on,
# and whose targets it drops, is never recorded afterwards. Covers the node's estimate of the
# master's clock (node/clock.py) and its loop's lag.
MOVE_DECIDED_BEFORE_TIMEOUT_MS = 5_000
# Frames a server lets wait behind a file-backed one (`_held`) before it reads no more of that
# peer's requests, until they are sent: a disk read's frame keeps its files open until then,
# so a reader that stalls holds a bounded number of descriptors (before, 2,000 more with each
# request it sent, until the node had none left for anyone). A node's transfer server counts
# the disk reads still being opened too (start_server's `replies_owed_max`).
HELD_FRAMES_MAX = 8
# The master's DRAM eviction order (master/eviction.py POLICIES; kvpool master --eviction-policy).
EVICTION_POLICY_DEFAULT = "probation"
# A put that found no room tries its keys again, after the moves and drops in flight, at most
# this many times (and within the master's PUT_ROOM_WAIT_MS): with every tier full, room comes
# in two steps (the disk tier drops to take DRAM's offloads; the offloads land and DRAM drops
# what they moved), and puts arriving meanwhile may take room that landed for a waiting one
# (four putters into a full 16 MiB segment, watermark 1.0: up to 7 rounds; docs/tiers.md).
PUT_ROOM_ROUNDS_MAX = 16
# An object read this many times from a slower tier within a promotion window is copied back
# into DRAM; at most PROMOTIONS_PER_TICK_MAX are started per master tick, and at most
# PROMOTION_CANDIDATES_MAX keys are counted at once (the counts restart when it fills up).
PROMOTE_READS_DEFAULT = 3
PROMOTION_WINDOW_MS_DEFAULT = 60_000
PROMOTIONS_PER_TICK_MAX = 32
PROMOTION_CANDIDATES_MAX = 65_536
# A temporary file in the DFS directory older than this has lost its writer: a starting
# master removes it.
DFS_TEMP_FILE_AGE_MS_MAX = 3_600_000

assert MOVE_INFLIGHT_BYTES_PER_NODE_MAX <= MOVE_QUEUE_BYTES_MAX
assert OBJECT_SIZE_BYTES_MAX <= MOVE_QUEUE_BYTES_MAX * 2
assert MOVE_ITEMS_PER_REQUEST_MAX <= BATCH_KEYS_MAX
assert DROP_ENTRIES_PER_REQUEST_MAX <= BATCH_KEYS_MAX
