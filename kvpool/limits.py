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
FRAME_VERSION = 1
# A control message is metadata only (keys, offsets, codes); 64 MiB holds a batch of 16,384
# maximal keys with room to spare, and bounds what a malicious peer can make us buffer.
FRAME_CONTROL_SIZE_BYTES_MAX = 64 * MIB
# A payload rides in one frame up to this size; larger transfers are cut into slices.
SLICE_SIZE_BYTES_MAX = 64 * MIB
FRAME_PAYLOAD_SIZE_BYTES_MAX = 1 * GIB
REQUEST_ID_MAX = 2**32 - 1

# --- objects and keys ------------------------------------------------------------------------
KEY_SIZE_BYTES_MAX = 4 * KIB
OBJECT_SIZE_BYTES_MAX = 1 * GIB
BATCH_KEYS_MAX = 16_384
REPLICA_NUM_MAX = 8
REGEX_SIZE_BYTES_MAX = 4 * KIB
LIST_OBJECTS_MAX = 100_000

# --- allocation ------------------------------------------------------------------------------
# Every allocation starts on a cache line, so that copies into a segment never straddle one
# needlessly. KV-cache slices are multiples of kilobytes, so the waste is nil in practice.
ALLOCATION_ALIGN_BYTES = 64
SEGMENT_SIZE_BYTES_MIN = 1 * MIB
SEGMENT_SIZE_BYTES_MAX = 1024 * GIB
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
# A writer silent past the discard timeout loses its put (the key becomes free again); its
# space is released only after the release timeout, so a slow writer can never scribble on
# someone else's object (Mooncake put_start_discard_timeout_sec=30, release_timeout_sec=600).
PUT_DISCARD_TIMEOUT_MS_DEFAULT = 30_000
PUT_RELEASE_TIMEOUT_MS_DEFAULT = 600_000
EVICT_WATERMARK_RATIO_HIGH_DEFAULT = 0.90
EVICT_RATIO_DEFAULT = 0.05

# --- membership ------------------------------------------------------------------------------
NODE_TTL_MS_DEFAULT = 10_000
HEARTBEAT_INTERVAL_MS_DEFAULT = 1_000
DRAIN_TIMEOUT_MS_DEFAULT = 30_000
# A master restarted with no memory waits this long for nodes to re-mount before it treats an
# absent node as gone; during the wait it serves what it knows.
REMOUNT_GRACE_MS_DEFAULT = 3_000

# --- client and connections -------------------------------------------------------------------
MASTER_PORT_DEFAULT = 50051
MASTER_HTTP_PORT_DEFAULT = 9100
RPC_TIMEOUT_MS_DEFAULT = 5_000
CONNECT_TIMEOUT_MS_DEFAULT = 2_000
TRANSFER_TIMEOUT_MS_DEFAULT = 30_000
CONNECTIONS_PER_PEER_DEFAULT = 4
CONNECTIONS_PER_PEER_MAX = 64
RPC_RETRY_COUNT_MAX = 3
INFLIGHT_REQUESTS_PER_CONNECTION_MAX = 4_096
RECONNECT_BACKOFF_MS_MAX = 2_000
AUTH_NONCE_SIZE_BYTES = 32
AUTH_TIMEOUT_MS = 2_000
REGISTERED_BUFFERS_MAX = 65_536

assert FRAME_HEADER_SIZE_BYTES == struct.calcsize(FRAME_HEADER_FMT)
assert SLICE_SIZE_BYTES_MAX % PAGE_SIZE_BYTES == 0
assert SLICE_SIZE_BYTES_MAX <= FRAME_PAYLOAD_SIZE_BYTES_MAX
assert OBJECT_SIZE_BYTES_MAX <= FRAME_PAYLOAD_SIZE_BYTES_MAX
assert SEGMENT_HEADER_SIZE_BYTES % PAGE_SIZE_BYTES == 0
assert SEGMENT_HEADER_SIZE_BYTES % ALLOCATION_ALIGN_BYTES == 0
assert PUT_DISCARD_TIMEOUT_MS_DEFAULT < PUT_RELEASE_TIMEOUT_MS_DEFAULT
assert HEARTBEAT_INTERVAL_MS_DEFAULT * 3 <= NODE_TTL_MS_DEFAULT
assert 0.0 < EVICT_RATIO_DEFAULT < EVICT_WATERMARK_RATIO_HIGH_DEFAULT <= 1.0
assert CONNECTIONS_PER_PEER_DEFAULT <= CONNECTIONS_PER_PEER_MAX
