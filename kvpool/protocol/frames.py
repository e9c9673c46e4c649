"""The wire format, sans-IO: frames in, events out; no sockets, no clocks.

A frame is a fixed header, a msgpack control message, then raw payload bytes:

    0        2     3      4            8              12                     20
    +--------+-----+------+------------+--------------+----------------------+
    | magic  | ver | flags| request_id | control_size |     payload_size     |
    +--------+-----+------+------------+--------------+----------------------+
    | control message: msgpack, control_size bytes (messages.py)            |
    +------------------------------------------------------------------------+
    | payload: payload_size raw bytes (object data), optional                |
    +------------------------------------------------------------------------+

`FrameDecoder` turns received bytes into `Frame` and `PayloadDone` events. It is built for
zero-copy reception: when a frame announces a payload, its owner names where the bytes must go
(`set_payload_sinks`, e.g. a range of a mapped segment or a caller's registered buffer) and the
decoder then hands out those very buffers to the socket (`get_buffer`, the asyncio
BufferedProtocol contract). Only bytes that arrived together with the header, and payloads of
small sinks (DIRECT_SINK_BYTES_MIN), are received into a staging buffer and copied, once.

Malformed input (bad magic or version, oversized lengths, undecodable or unknown messages)
raises `RemoteProtocolError`; the decoder is then unusable and the connection must be closed.

A frame with a large payload may pad its control message (FLAG_PADDED; `payload_padding`
says why): the padding's last byte holds its length, and the decoder drops it.

On a connection whose handshake proved the cluster token, every frame after it is sealed
(FLAG_SEALED): its control message ends with a tag, a keyed BLAKE2b MAC of the frame's header and
control message and of its place in that direction's sequence (`FrameSeal`; the keys are the
connection's own, protocol/auth.py `frame_seals`). A frame altered, injected, replayed, dropped
or reordered on the way fails the check, and the connection closes. A sealed frame's payload
is followed by a tag of its own (`PAYLOAD_TAG_SIZE_BYTES`, not counted in payload_size): a
Poly1305 MAC under a one-time key derived from the seal's key and the frame's place
(`FrameSeal.payload_mac`), fed as the bytes land in their sinks, and checked before the
PayloadDone that lets anyone act on them. The object checksum (xxh3) every read verifies
catches bytes that rot, not a relay that computes replacement bytes of the same checksum: a
review forged objects so. Poly1305 (the `cryptography` package's, OpenSSL's) hashes ~13 GB/s on
this project's VM, where keyed BLAKE2b hashes 0.9 and TCP puts move ~2.8 (ad hoc).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from typing import Final

import msgspec
import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvpool import limits
from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.protocol.messages import REPLY_TYPES, AnyMessage, Message

FLAG_REPLY: Final = 0x01  # The frame answers the peer's request with the same id.
FLAG_PADDED: Final = 0x02  # The control message ends with padding; its last byte is the length.
FLAG_SEALED: Final = 0x04  # The control message ends with the frame's tag (FrameSeal).
_FLAGS_KNOWN: Final = FLAG_REPLY | FLAG_PADDED | FLAG_SEALED

_header = struct.Struct(limits.FRAME_HEADER_FMT)


class WireVersionMismatch(RemoteProtocolError):
    """The peer's frames are of another wire version."""


def version_notice() -> bytes:
    """What a client sends a server whose challenge came in another wire version, before it
    closes: a frame header of its own version (and room for a longer header), for the server
    to say in its log why the peer went (it said nothing: the client, which hears first, just
    closed). The magic and version lead the header in every version."""
    header = _header.pack(limits.FRAME_MAGIC, limits.FRAME_VERSION, 0, 0, 0, 0)
    return header + bytes(max(0, VERSION_NOTICE_BYTES - len(header)))


VERSION_NOTICE_BYTES = 64


def _as_plain(value: object) -> object:
    """A str subclass (numpy.str_, as an array of key strings yields) goes as its text: the
    client's key check takes it for the str it is (client/store.py key_list)."""
    if isinstance(value, str):
        return str(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_as_plain)
_decoder = msgspec.msgpack.Decoder(AnyMessage)

# What a connection's staging buffer starts at and goes back to: room for a batch's control
# message in one receive, and all an idle connection holds (a master serves every client's
# connection; 256 KiB each took 3,000 idle ones to 848 MB). A larger control message grows it.
_STAGING_IDLE_BYTES: Final = 16 * limits.KIB
# Room for payload bytes of small sinks (or discarded): a payload larger than the room left
# grows the buffer to this, so that one receive fills many sinks; a connection that carried
# one keeps it (not one whose payload was discarded).
_STAGING_PAYLOAD_BYTES: Final = 256 * limits.KIB
# A payload sink smaller than this is filled through the staging buffer: one receive
# call for many small sinks (a batch of 4 KiB objects) and a copy out of it cost less than a
# receive call per sink (a system call and two Python calls each, ~7 us here; a copy of 64 KiB
# takes about as long).
DIRECT_SINK_BYTES_MIN: Final = 64 * limits.KIB


# A copy by `rep movsb` (the kernel's copies into and out of socket buffers and the page
# cache; glibc's memcpy from 2 KiB) runs 8-11x slower on this AMD EPYC when its destination
# lies 1-31 bytes past its source modulo 4 KiB, and up to 20% slower at 32-63 bytes
# (`bench_paths.py payload-alignment`, docs/performance.md "Where a payload lands").
PAGE_BYTES: Final = 4 * limits.KIB
SLOW_COPY_OFFSET_MAX: Final = 63
PADDING_BYTES_MAX: Final = 255
# Payloads smaller than this are not padded: their copies are too short to matter.
PADDED_PAYLOAD_BYTES_MIN: Final = 4 * limits.KIB


def is_slow_copy(source: int, destination: int) -> bool:
    return 0 < (destination - source) % PAGE_BYTES <= SLOW_COPY_OFFSET_MAX


def payload_padding(header_bytes: int, source: int | None, landing: int | None) -> int:
    """Bytes of padding to put after a control message of `header_bytes` (frame header
    included) so that neither copy of the payload that follows hits the slow case above.

    Over TCP the sender's kernel copies the payload (from `source`) into socket-buffer pages;
    when the connection is idle, as it is when a request starts, the frame starts a page, so
    the payload lands at offset `header_bytes + padding` of it. Over loopback the receiver's
    kernel copies from those pages into `landing`. Both addresses are taken modulo 4 KiB;
    None means unknown (no constraint). Returns 0 (no padding) or 1..PADDING_BYTES_MAX, the
    least that keeps both copies fast (0 when none does).
    """
    if source is None and landing is None:
        return 0
    # The slow paddings form two runs (one per copy); the least fast one is 0 or follows a run.
    candidates = {0}
    if source is not None:
        candidates.add((source + SLOW_COPY_OFFSET_MAX + 1 - header_bytes) % PAGE_BYTES)
    if landing is not None:
        candidates.add((landing - header_bytes) % PAGE_BYTES)
    for padding in sorted(candidates):
        start = header_bytes + padding
        if padding <= PADDING_BYTES_MAX and not (source is not None and is_slow_copy(source, start)) and not (
            landing is not None and is_slow_copy(start, landing)
        ):
            return padding
    return 0


def buffer_address(buffer: memoryview | bytes) -> int:
    """Where a buffer's first byte is in this process's memory (read-only buffers too)."""
    view = memoryview(buffer)
    if view.readonly or not view.nbytes:  # ctypes takes neither; numpy is slower (1.5 us)
        return np.frombuffer(view, np.uint8).ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class FrameSeal:
    """The MAC of one direction of one authenticated connection: `tag` of each frame's header
    and control message, in the order the frames go (the sender tags each as it encodes it, the
    receiver checks each as it decodes it), so a frame's tag holds for that place only. Its key
    is the connection's own (protocol/auth.py frame_seals): a tag of another connection, or of
    the other direction, never holds. Keyed BLAKE2b (RFC 7693 MAC mode): ~0.5 us a frame here,
    a quarter of HMAC-SHA256's."""

    __slots__ = ("_key", "_mac", "_sequence")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._mac = hashlib.blake2b(key=key, digest_size=limits.FRAME_TAG_SIZE_BYTES)
        self._sequence = 0

    def tag(self, frame: bytes | bytearray | memoryview) -> bytes:
        """The tag of the next frame of this direction (header and control message, padding
        included, tag excluded); each call is the next place in the sequence."""
        mac = self._mac.copy()
        mac.update(self._sequence.to_bytes(8, "little"))
        mac.update(frame)
        self._sequence += 1
        return mac.digest()

    def payload_mac(self) -> Poly1305:
        """The MAC of the payload of the frame last tagged: Poly1305 under a key of that frame
        alone (Poly1305's key must never serve two messages), derived from this seal's key and
        the frame's place."""
        place = (self._sequence - 1).to_bytes(8, "little")
        return Poly1305(hashlib.blake2b(place, key=self._key, digest_size=32, person=b"kvpool payload").digest())


def payload_tag(mac: Poly1305, parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """The tag that follows a sealed frame's payload held in memory: `mac` (payload_mac, taken
    right after the frame's header was encoded) of its parts, in order."""
    for part in parts:
        mac.update(part)
    return mac.finalize()


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = Sentinel.NEED_DATA


class Frame(msgspec.Struct):
    """A decoded header and control message. When `payload_size` > 0 the decoder waits for
    `set_payload_sinks` before it returns anything else."""

    request_id: int
    is_reply: bool
    message: Message
    payload_size: int


class PayloadDone(msgspec.Struct):
    """All payload bytes of the frame with this request id are in their sinks."""

    request_id: int


Event = Frame | PayloadDone | Sentinel


def encode_frame(
    message: Message,
    request_id: int,
    *,
    is_reply: bool = False,
    payload_size: int = 0,
    payload_source: int | None = None,
    payload_landing: int | None = None,
    seal: FrameSeal | None = None,
) -> bytes:
    """Header plus control message; the caller sends `payload_size` payload bytes after it.
    Given where the payload is read from or lands, the control message is padded so that
    its copies are fast (payload_padding). With `seal` (a connection past its handshake with
    a token) the control message ends with the frame's tag: encode a frame only to send it
    next on that connection, as the tag holds for that place in its sequence only.

    Raises:
        LocalProtocolError: a field is out of range (a bug on the sending side).
    """
    if not 0 <= request_id <= limits.REQUEST_ID_MAX:
        raise LocalProtocolError(f"request id {request_id} out of range")
    if not 0 <= payload_size <= limits.FRAME_PAYLOAD_SIZE_BYTES_MAX:
        raise LocalProtocolError(f"payload of {payload_size} bytes exceeds the frame limit")
    if is_reply != isinstance(message, REPLY_TYPES):
        raise LocalProtocolError(f"{type(message).__name__} sent with is_reply={is_reply}")
    buffer = bytearray(limits.FRAME_HEADER_SIZE_BYTES)
    _encoder.encode_into(message, buffer, limits.FRAME_HEADER_SIZE_BYTES)
    flags = FLAG_REPLY if is_reply else 0
    tag_size = 0
    if seal is not None:
        flags |= FLAG_SEALED
        tag_size = limits.FRAME_TAG_SIZE_BYTES
    if payload_size >= PADDED_PAYLOAD_BYTES_MIN:
        padding = payload_padding(len(buffer) + tag_size, payload_source, payload_landing)
        if padding:
            buffer += bytes(padding - 1)
            buffer.append(padding)
            flags |= FLAG_PADDED
    control_size = len(buffer) + tag_size - limits.FRAME_HEADER_SIZE_BYTES
    if control_size > limits.FRAME_CONTROL_SIZE_BYTES_MAX:
        raise LocalProtocolError(f"control message of {control_size} bytes exceeds the limit")
    _header.pack_into(
        buffer, 0, limits.FRAME_MAGIC, limits.FRAME_VERSION, flags, request_id,
        control_size, payload_size,
    )  # fmt: skip
    if seal is not None:
        buffer += seal.tag(buffer)
    return bytes(buffer)


class _State(enum.Enum):
    FRAME = "FRAME"  # Expecting a header and control message (from the staging buffer).
    NEED_SINK = "NEED_SINK"  # A Frame with payload was returned; waiting for its sinks.
    PAYLOAD = "PAYLOAD"  # Filling the sinks.
    BROKEN = "BROKEN"


class FrameDecoder:
    """Incremental decoder for one direction of one connection.

    Bytes arrive either through `receive_data(bytes)` (tests, fuzzing) or through the
    `get_buffer()` / `buffer_updated(n)` pair (asyncio.BufferedProtocol). Events come out of
    `next_event()` until it returns NEED_DATA.

    Invariants: `_start <= _end <= len(_staging)`; in PAYLOAD state `_sink_left` is the number
    of payload bytes still owed, and the current sink has room for at least one of them.
    """

    def __init__(
        self,
        control_size_bytes_max: int = limits.FRAME_CONTROL_SIZE_BYTES_MAX,
        payload_size_bytes_max: int = limits.FRAME_PAYLOAD_SIZE_BYTES_MAX,
    ) -> None:
        self._control_size_bytes_max = control_size_bytes_max
        self._payload_size_bytes_max = payload_size_bytes_max
        self._staging = bytearray(_STAGING_IDLE_BYTES)
        self._start = 0
        self._end = 0
        self._state = _State.FRAME
        self._request_id = 0
        self._sinks: list[memoryview] = []
        self._sink_index = 0
        self._sink_pos = 0
        self._sink_left = 0
        self._discard = False
        self._on_landed: Callable[[memoryview], None] | None = None
        self._seal: FrameSeal | None = None  # the peer's frames' MAC, once authenticated
        self._payload_mac: Poly1305 | None = None  # of the sealed payload being received
        self._buffer_is_sink = False  # where the buffer last handed out by get_buffer points
        self._frame_bytes = 0  # size of the unfinished frame at _start, once its header came
        self.frames_decoded = 0  # how many frames next_event returned (a frame's identity)

    def __repr__(self) -> str:
        return f"<FrameDecoder {self._state.value} buffered={self._end - self._start}>"

    # --- input --------------------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written (never empty)."""
        assert self._state is not _State.BROKEN, "decoder used after a protocol error"
        self._buffer_is_sink = (
            self._state is _State.PAYLOAD
            and self._sink_left > 0
            and self._start == self._end
            and not self._discard
            and len(self._sinks[self._sink_index]) >= DIRECT_SINK_BYTES_MIN
        )
        if self._buffer_is_sink:
            sink = self._sinks[self._sink_index]
            return sink[self._sink_pos :]
        if self._start == self._end:
            self._start = self._end = 0
            # A large frame is over, or a payload nobody took (a master takes none: any token
            # holder could leave each of 20,000 connections holding 256 KiB): let its room go.
            was_discarded = self._discard and self._state is not _State.PAYLOAD
            if len(self._staging) > (_STAGING_IDLE_BYTES if was_discarded else _STAGING_PAYLOAD_BYTES):
                self._staging = bytearray(_STAGING_IDLE_BYTES)
        staging_bytes = len(self._staging)
        if self._state is _State.PAYLOAD and staging_bytes < _STAGING_PAYLOAD_BYTES:
            to_come = self._sink_left - min(self._end - self._start, self._sink_left)
            if to_come > staging_bytes - self._end:  # more payload to come than the room left
                self._compact()
                self._grow(_STAGING_PAYLOAD_BYTES)
                staging_bytes = len(self._staging)
        if staging_bytes - self._end < 4 * limits.KIB or self._start + self._frame_bytes > staging_bytes:
            self._compact()
            # Full of an unfinished frame: twice the room, up to that frame's size (known once
            # its header came, and bounded by next_event). Grown as its bytes come, never to
            # the size a header announces: 21 bytes must not buy 64 MiB.
            if staging_bytes - self._end < 4 * limits.KIB:
                wanted = 2 * staging_bytes
                if self._frame_bytes > staging_bytes:
                    wanted = min(wanted, self._frame_bytes + 4 * limits.KIB)
                self._grow(wanted)
        return memoryview(self._staging)[self._end :]

    @property
    def is_mid_frame(self) -> bool:
        """Whether part of a frame's header or control message is buffered, the rest owed
        (a payload's bytes do not count: they land in their sinks, not here)."""
        return self._state is _State.FRAME and self._end > self._start

    def limit_control_size(self, size_bytes: int) -> None:
        """The largest control message accepted from now on (a connection not yet
        authenticated takes only its handshake's)."""
        self._control_size_bytes_max = size_bytes

    def expect_seal(self, seal: FrameSeal) -> None:
        """Every frame from now on must carry its tag under `seal` (the handshake proved the
        token): one without, or with a wrong one, is a RemoteProtocolError."""
        self._seal = seal

    def buffer_updated(self, size_bytes: int) -> bool:
        """`size_bytes` bytes were written into the buffer last returned by get_buffer.
        Returns False when next_event has nothing new to say: the bytes went into a payload
        sink and more are owed (a large payload comes in many receives; this spares each the
        walk through next_event)."""
        assert size_bytes > 0, size_bytes
        if self._buffer_is_sink:
            self._advance_sink(size_bytes)
            return self._sink_left == 0
        self._end += size_bytes
        assert self._end <= len(self._staging), (self._end, len(self._staging))
        return True

    def receive_data(self, data: bytes) -> None:
        """Feed bytes by copying them (the h11-style entry point for tests and fuzzing)."""
        view = memoryview(data)
        while view:
            buffer = self.get_buffer()
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            buffer.release()  # the staging buffer may grow at the next get_buffer
            view = view[size:]
            self.buffer_updated(size)
            # Payload bytes sitting in staging must move to their sinks before staging fills.
            if self._state is _State.PAYLOAD and self._start != self._end:
                self._drain_staging_into_sinks()

    # --- output -------------------------------------------------------------------------

    def set_payload_sinks(
        self, sinks: Sequence[memoryview] | None, on_landed: Callable[[memoryview], None] | None = None
    ) -> None:
        """Name the buffers for the payload of the last Frame, in order; None discards it.
        `on_landed`, if given, sees each piece of the payload as it lands, in order (a view of
        the sink it landed in): the reader hashes a read while its bytes are in cache.

        Raises:
            LocalProtocolError: not expected now, or the sinks do not add up to the payload.
        """
        if self._state is not _State.NEED_SINK:
            raise LocalProtocolError(f"set_payload_sinks in state {self._state.value}")
        if sinks is None:
            self._discard = True
            self._sinks = []
        else:
            views = [memoryview(s).cast("B") for s in sinks]
            total = sum(len(v) for v in views)
            if total != self._sink_left:
                raise LocalProtocolError(f"sinks hold {total} bytes, payload is {self._sink_left}")
            self._sinks = [v for v in views if len(v)]
            self._discard = False
        self._on_landed = None if sinks is None else on_landed
        self._sink_index = 0
        self._sink_pos = 0
        self._state = _State.PAYLOAD

    def next_event(self) -> Event:
        """The next complete event, or NEED_DATA.

        Raises:
            RemoteProtocolError: the peer sent a malformed frame; the decoder is now broken.
            LocalProtocolError: called while a Frame's payload sinks are still owed.
        """
        if self._state is _State.NEED_SINK:
            raise LocalProtocolError("set_payload_sinks must follow a Frame with a payload")
        if self._state is _State.BROKEN:
            raise LocalProtocolError("decoder used after a protocol error")
        if self._state is _State.PAYLOAD:
            self._drain_staging_into_sinks()
            if self._sink_left:
                return NEED_DATA
            if self._payload_mac is not None:
                if self._end - self._start < limits.PAYLOAD_TAG_SIZE_BYTES:
                    return NEED_DATA
                try:
                    self._check_payload_tag()
                except RemoteProtocolError:
                    self._state = _State.BROKEN
                    raise
            self._state = _State.FRAME
            self._sinks = []
            self._on_landed = None
            return PayloadDone(self._request_id)
        try:
            return self._next_frame()
        except RemoteProtocolError:
            self._state = _State.BROKEN
            raise

    # --- internals ----------------------------------------------------------------------

    def _next_frame(self) -> Event:
        available = self._end - self._start
        if available < limits.FRAME_HEADER_SIZE_BYTES:
            return NEED_DATA
        magic, version, flags, request_id, control_size, payload_size = _header.unpack_from(
            self._staging, self._start
        )
        if magic != limits.FRAME_MAGIC:
            if self.frames_decoded == 0:  # another protocol: SSH, HTTP, etcd's gRPC, ...
                first = bytes(self._staging[self._start : self._start + _header.size])
                raise RemoteProtocolError(f"not a kvpool peer (a wrong port?): it sent {first!r}")
            raise RemoteProtocolError(f"bad frame magic 0x{magic:04x}")
        if version != limits.FRAME_VERSION:
            raise WireVersionMismatch(
                f"the peer speaks wire version {version}, this process {limits.FRAME_VERSION}: "
                "run one kvpool version across the cluster"
            )
        if flags & ~_FLAGS_KNOWN:
            raise RemoteProtocolError(f"unknown frame flags 0x{flags:02x}")
        if control_size > self._control_size_bytes_max:
            raise RemoteProtocolError(f"control message of {control_size} bytes is too large")
        if payload_size > self._payload_size_bytes_max:
            raise RemoteProtocolError(f"payload of {payload_size} bytes is too large")
        frame_size = limits.FRAME_HEADER_SIZE_BYTES + control_size
        if available < frame_size:
            self._frame_bytes = frame_size  # get_buffer makes room for it
            return NEED_DATA
        self._frame_bytes = 0
        body_start = self._start + limits.FRAME_HEADER_SIZE_BYTES
        body_end = body_start + control_size
        if flags & FLAG_SEALED or self._seal is not None:
            body_end = self._check_tag(flags, body_end)
        if flags & FLAG_PADDED:
            padding = self._staging[body_end - 1] if body_end > body_start else 0
            if not 0 < padding <= body_end - body_start:
                raise RemoteProtocolError(f"padding of {padding} bytes in a control message of {control_size}")
            body_end -= padding
        body = memoryview(self._staging)[body_start:body_end]
        try:
            message = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"undecodable control message: {exc}") from exc
        finally:
            body.release()
        is_reply = bool(flags & FLAG_REPLY)
        if is_reply != isinstance(message, REPLY_TYPES):
            raise RemoteProtocolError(f"{type(message).__name__} with reply flag {is_reply}")
        self._start += frame_size
        self.frames_decoded += 1
        if payload_size:
            self._state = _State.NEED_SINK
            self._request_id = request_id
            self._sink_left = payload_size
            self._payload_mac = self._seal.payload_mac() if self._seal is not None else None
        return Frame(request_id, is_reply, message, payload_size)

    def _check_tag(self, flags: int, body_end: int) -> int:
        """Check the tag that ends the control message at `body_end`; returns where the
        control message ends without it.

        Raises:
            RemoteProtocolError: a sealed frame before the handshake, an unsealed one after,
                or a tag that does not hold (the frame was altered, injected, replayed or
                reordered on the way, or its sender holds another token).
        """
        if self._seal is None:
            raise RemoteProtocolError("a sealed frame before the handshake")
        if not flags & FLAG_SEALED:
            raise RemoteProtocolError("a frame without its tag after the handshake (a peer of another version?)")
        tag_start = body_end - limits.FRAME_TAG_SIZE_BYTES
        if tag_start < self._start + limits.FRAME_HEADER_SIZE_BYTES:
            raise RemoteProtocolError("a sealed control message too short to hold its tag")
        with memoryview(self._staging) as staging:
            expected = self._seal.tag(staging[self._start : tag_start])
            if not hmac.compare_digest(expected, staging[tag_start:body_end]):
                raise RemoteProtocolError(
                    "a frame whose tag does not hold: altered, injected, replayed or reordered on the way"
                )
        return tag_start

    def _check_payload_tag(self) -> None:
        """Check the tag after a sealed payload (its bytes all landed and fed to the MAC).

        Raises:
            RemoteProtocolError: it does not hold: the payload was changed on the way.
        """
        assert self._payload_mac is not None
        mac, self._payload_mac = self._payload_mac, None
        tag_end = self._start + limits.PAYLOAD_TAG_SIZE_BYTES
        try:
            mac.verify(bytes(self._staging[self._start : tag_end]))
        except InvalidSignature:
            raise RemoteProtocolError(
                "a payload whose tag does not hold: changed on the way (its bytes are not taken)"
            ) from None
        self._start = tag_end

    def _drain_staging_into_sinks(self) -> None:
        """Move payload bytes that arrived in the staging buffer to their sinks."""
        while self._sink_left and self._start < self._end:
            size = min(self._end - self._start, self._sink_left)
            if not self._discard:
                sink = self._sinks[self._sink_index]
                size = min(size, len(sink) - self._sink_pos)
                sink[self._sink_pos : self._sink_pos + size] = memoryview(self._staging)[
                    self._start : self._start + size
                ]
                self._start += size
                self._advance_sink(size)
            else:
                if self._payload_mac is not None:
                    with memoryview(self._staging) as staging:
                        self._payload_mac.update(staging[self._start : self._start + size])
                self._start += size
                self._sink_left -= size

    def _advance_sink(self, size_bytes: int) -> None:
        assert size_bytes <= self._sink_left, (size_bytes, self._sink_left)
        if self._on_landed is not None or self._payload_mac is not None:
            landed = self._sinks[self._sink_index][self._sink_pos : self._sink_pos + size_bytes]
            if self._payload_mac is not None:
                self._payload_mac.update(landed)
            if self._on_landed is not None:
                self._on_landed(landed)
        self._sink_left -= size_bytes
        self._sink_pos += size_bytes
        if self._sink_pos == len(self._sinks[self._sink_index]):
            self._sink_index += 1
            self._sink_pos = 0
        assert self._sink_left == 0 or self._sink_index < len(self._sinks), "sinks exhausted"

    def _compact(self) -> None:
        """Move the unconsumed bytes to the start. Nothing to do at the start already: a
        frame larger than the buffer compacts at every receive while it comes, and copying
        what it had received each time made a 64 MiB control message take seconds."""
        if self._start == 0:
            return
        size = self._end - self._start
        self._staging[:size] = self._staging[self._start : self._end]
        self._start, self._end = 0, size

    def _grow(self, frame_size: int) -> None:
        """A larger staging buffer with the unconsumed bytes at its start (get_buffer compacted
        them there). A new one, not the old one resized: a view of the old one may still be
        held (uvloop keeps the buffer of a receive that brought nothing until it asks for the
        next), and resizing a bytearray with views of it alive raises BufferError, which killed
        the connection."""
        assert self._start == 0, "grown only once compacted"
        if len(self._staging) < frame_size:
            grown = bytearray(frame_size)
            grown[: self._end] = memoryview(self._staging)[: self._end]
            self._staging = grown
