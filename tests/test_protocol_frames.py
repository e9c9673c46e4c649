"""The sans-IO wire format: frames encoded, then decoded whole, byte by byte and with trailing
bytes (h11's habit); payloads land in the sinks the owner names; malformed input of every kind
raises RemoteProtocolError and nothing else (hypothesis feeds random and mutated frames)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import msgspec
import msgspec.inspect
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool import limits
from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.protocol import messages
from kvpool.protocol.frames import (
    DIRECT_SINK_BYTES_MIN,
    FLAG_PADDED,
    FLAG_SEALED,
    NEED_DATA,
    PADDED_PAYLOAD_BYTES_MIN,
    PADDING_BYTES_MAX,
    PAGE_BYTES,
    Frame,
    FrameDecoder,
    FrameSeal,
    PayloadDone,
    buffer_address,
    encode_frame,
    is_slow_copy,
    payload_padding,
    payload_tag,
)
from kvpool.protocol.messages import (
    CodesReply,
    GetReplicaList,
    PutStart,
    PutStartReply,
    ReadReply,
    ReplicateConfig,
    WriteGrant,
    WriteItem,
    WriteSlices,
)


def drain(decoder: FrameDecoder, sinks_for=None) -> list:
    events = []
    while True:
        event = decoder.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if isinstance(event, Frame) and event.payload_size:
            decoder.set_payload_sinks(sinks_for(event) if sinks_for else None)


def test_control_frame_round_trips_whole_and_byte_by_byte():
    message = PutStart(["a", "b" * 100], [4096, 1 << 20], ReplicateConfig(replica_num=2), "host")
    wire = encode_frame(message, 7)
    whole = FrameDecoder()
    whole.receive_data(wire)
    assert drain(whole) == [Frame(7, False, message, 0)]

    trickled = FrameDecoder()
    events = []
    for byte in wire:
        trickled.receive_data(bytes([byte]))
        events += drain(trickled)
    assert events == [Frame(7, False, message, 0)]


def test_many_frames_in_one_buffer_and_trailing_partial_frame():
    messages = [GetReplicaList([f"key-{i}"]) for i in range(50)]
    wire = b"".join(encode_frame(m, i + 1) for i, m in enumerate(messages))
    extra = encode_frame(CodesReply([0, -704]), 99, is_reply=True)
    decoder = FrameDecoder()
    decoder.receive_data(wire + extra[:5])
    events = drain(decoder)
    assert [e.message for e in events] == messages
    decoder.receive_data(extra[5:])
    assert drain(decoder) == [Frame(99, True, CodesReply([0, -704]), 0)]


@pytest.mark.parametrize("chunk", [1, 3, 64, 4096, 1 << 20])
def test_payload_lands_in_scattered_sinks(chunk):
    payload = bytes(range(256)) * 1000  # 256,000 bytes
    grant = WriteGrant("seg", 0, len(payload), 0)
    message = WriteSlices([WriteItem(grant, 0, len(payload))])
    wire = encode_frame(message, 3, payload_size=len(payload)) + payload
    wire += encode_frame(CodesReply([0]), 4, is_reply=True)
    sinks = [bytearray(1000), bytearray(0), bytearray(len(payload) - 1000)]
    decoder = FrameDecoder()
    events = []
    for start in range(0, len(wire), chunk):
        decoder.receive_data(wire[start : start + chunk])
        events += drain(decoder, lambda frame: [memoryview(s) for s in sinks])
    assert events[0] == Frame(3, False, message, len(payload))
    assert events[1] == PayloadDone(3)
    assert events[2].message == CodesReply([0])
    assert bytes(sinks[0] + sinks[2]) == payload


def test_payload_via_buffer_protocol_goes_straight_to_the_sink():
    payload = b"x" * (1 << 20)
    wire = encode_frame(ReadReply(len(payload)), 5, is_reply=True, payload_size=len(payload))
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    frame = decoder.next_event()
    sink = bytearray(len(payload))
    decoder.set_payload_sinks([memoryview(sink)])
    buffer = decoder.get_buffer()
    assert buffer.obj is sink  # zero copy: the socket writes into the caller's buffer
    buffer[: len(payload)] = payload
    decoder.buffer_updated(len(payload))
    assert decoder.next_event() == PayloadDone(frame.request_id)
    assert sink == payload


def test_small_sinks_fill_through_staging_with_one_receive_for_many():
    """Many small sinks (a batch of 4 KiB objects) are received into the staging buffer, many
    per receive call, and copied out; a large sink still gets the socket's bytes directly."""
    small, large = 4096, DIRECT_SINK_BYTES_MIN
    payload = os.urandom(32 * small + large)
    wire = encode_frame(ReadReply(len(payload)), 5, is_reply=True, payload_size=len(payload))
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    frame = decoder.next_event()
    sinks = [bytearray(small) for _ in range(32)] + [bytearray(large)]
    decoder.set_payload_sinks([memoryview(s) for s in sinks])
    buffer = decoder.get_buffer()
    assert buffer.obj not in sinks and len(buffer) >= 32 * small  # staging: room for all 32
    buffer[: 32 * small] = payload[: 32 * small]
    decoder.buffer_updated(32 * small)
    assert decoder.next_event() is NEED_DATA  # the 32 small ones are copied out now
    buffer = decoder.get_buffer()
    assert buffer.obj is sinks[-1]  # the large one: straight from the socket
    buffer[:large] = payload[32 * small :]
    decoder.buffer_updated(large)
    assert decoder.next_event() == PayloadDone(frame.request_id)
    assert b"".join(sinks) == payload


def test_discarded_payload_is_skipped():
    payload = b"y" * 5000
    wire = encode_frame(ReadReply(5000), 1, is_reply=True, payload_size=5000) + payload
    wire += encode_frame(CodesReply([1]), 2, is_reply=True)
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    events = drain(decoder)  # sinks None: discard
    assert [type(e) for e in events] == [Frame, PayloadDone, Frame]


def _received_in_pieces(decoder: FrameDecoder, wire: bytes, sinks_for) -> None:
    """Feed `wire` as a transport does (get_buffer, then buffer_updated), 64 KiB a receive."""
    position = 0
    while position < len(wire):
        buffer = decoder.get_buffer()
        size = min(len(buffer), len(wire) - position, 65536)
        buffer[:size] = wire[position : position + size]
        buffer.release()
        decoder.buffer_updated(size)
        position += size
        drain(decoder, sinks_for)


def test_a_discarded_payload_leaves_no_room_behind_where_small_sinks_keep_theirs():
    """A payload that grew the staging buffer to 256 KiB: the connection keeps that room when
    its payloads land in small sinks (a batch of 4 KiB pages, one receive for many), not when
    it was discarded (the master takes no payload: a token holder sending one on each of
    20,000 connections held 5 GiB there; review helper-56)."""
    size = 300_000
    wire = encode_frame(GetReplicaList(["k"]), 1, payload_size=size) + bytes(size)
    discarding = FrameDecoder()
    _received_in_pieces(discarding, wire, None)
    assert len(discarding.get_buffer()) == 16 * 1024
    pages = bytearray(size)
    taking = FrameDecoder()
    small = 4096
    _received_in_pieces(taking, wire, lambda _: [memoryview(pages)[i : i + small] for i in range(0, size, small)])
    assert len(taking.get_buffer()) == 256 * 1024


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3 * DIRECT_SINK_BYTES_MIN),
    st.lists(st.integers(1, DIRECT_SINK_BYTES_MIN + 100), min_size=1, max_size=8),
    st.lists(st.integers(1, 2 * DIRECT_SINK_BYTES_MIN), min_size=1, max_size=20),
)
def test_on_landed_sees_each_payload_byte_once_in_order_as_it_lands(size, sink_cuts, receives):
    """What a reader hashes as it lands (the client's TCP gets) must be exactly the payload:
    every byte once, in order, whether it went straight into a sink or through the staging
    buffer, and nothing of the next frame's payload, whose sinks came without `on_landed`."""
    payload = os.urandom(size)
    wire = encode_frame(ReadReply(size), 1, is_reply=True, payload_size=size) + payload
    wire += encode_frame(ReadReply(size), 2, is_reply=True, payload_size=size) + payload
    sinks, left = [], size
    for cut in sink_cuts:
        sinks.append(memoryview(bytearray(min(cut, left))))
        left -= len(sinks[-1])
    if left:
        sinks.append(memoryview(bytearray(left)))
    landed: list[bytes] = []
    decoder = FrameDecoder()
    events = []
    at, turn = 0, 0
    while at < len(wire):
        buffer = decoder.get_buffer()
        count = min(len(buffer), receives[turn % len(receives)], len(wire) - at)
        buffer[:count] = wire[at : at + count]
        buffer.release()
        decoder.buffer_updated(count)
        at, turn = at + count, turn + 1
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
            if isinstance(event, Frame):
                first = event.request_id == 1
                decoder.set_payload_sinks(
                    sinks if first else [memoryview(bytearray(size))],
                    (lambda view: landed.append(bytes(view))) if first else None,
                )
    assert [type(e) for e in events] == [Frame, PayloadDone] * 2
    assert b"".join(landed) == payload
    assert b"".join(bytes(s) for s in sinks) == payload


def test_sinks_must_match_the_payload_size():
    wire = encode_frame(ReadReply(10), 1, is_reply=True, payload_size=10)
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    decoder.next_event()
    with pytest.raises(LocalProtocolError):
        decoder.set_payload_sinks([memoryview(bytearray(9))])


def test_encode_rejects_a_reply_flag_mismatch_and_oversized_payload():
    with pytest.raises(LocalProtocolError):
        encode_frame(CodesReply([0]), 1)
    with pytest.raises(LocalProtocolError):
        encode_frame(GetReplicaList(["a"]), 1, payload_size=limits.FRAME_PAYLOAD_SIZE_BYTES_MAX + 1)


def _flags(wire: bytes) -> int:
    return struct.unpack_from(limits.FRAME_HEADER_FMT, wire)[2]


def test_a_padded_frame_decodes_whole_and_byte_by_byte_with_its_payload_intact():
    """A frame whose payload is read from 16 bytes past a page: its control message (27 bytes
    with the header) is padded so the payload starts at least 64 bytes past that in a page."""
    payload = os.urandom(2 * PADDED_PAYLOAD_BYTES_MIN)
    wire = encode_frame(ReadReply(len(payload)), 9, is_reply=True, payload_size=len(payload),
                        payload_source=16, payload_landing=None)  # fmt: skip
    assert _flags(wire) & FLAG_PADDED
    assert not is_slow_copy(16, len(wire)) and len(wire) - 16 < PAGE_BYTES
    for chunk in (len(wire) + len(payload), 1):
        decoder = FrameDecoder()
        sink = bytearray(len(payload))
        events = []
        data = wire + payload
        for start in range(0, len(data), chunk):
            decoder.receive_data(data[start : start + chunk])
            events += drain(decoder, lambda frame: [memoryview(sink)])
        assert events == [Frame(9, True, ReadReply(len(payload)), len(payload)), PayloadDone(9)]
        assert sink == payload


def test_small_payloads_and_unknown_addresses_are_not_padded():
    unpadded = encode_frame(ReadReply(100), 1, is_reply=True, payload_size=100)
    assert encode_frame(ReadReply(100), 1, is_reply=True, payload_size=100, payload_source=16) == unpadded
    large = PADDED_PAYLOAD_BYTES_MIN
    plain = encode_frame(ReadReply(large), 1, is_reply=True, payload_size=large)
    assert not _flags(plain) & FLAG_PADDED
    assert encode_frame(ReadReply(large), 1, is_reply=True, payload_size=large, payload_source=len(plain)) == plain


@pytest.mark.parametrize("padding_byte", [0, 200], ids=["zero", "longer-than-the-message"])
def test_bad_padding_is_a_protocol_error(padding_byte):
    def wire(padding: int) -> bytes:
        control = b"\x92\x3e\x00" + bytes([padding])  # ReadReply(0), then one byte of padding
        return _header(flags=1 | FLAG_PADDED, control=len(control)) + control

    decoder = FrameDecoder()
    decoder.receive_data(wire(1))
    assert drain(decoder) == [Frame(1, True, ReadReply(0), 0)]
    decoder.receive_data(wire(padding_byte))
    with pytest.raises(RemoteProtocolError):
        drain(decoder)


def _sealed_pair() -> tuple[FrameSeal, FrameDecoder]:
    """A sender's seal and a receiver's decoder that expects its frames (one key)."""
    key = os.urandom(32)
    decoder = FrameDecoder()
    decoder.expect_seal(FrameSeal(key))
    return FrameSeal(key), decoder


def test_sealed_frames_decode_whole_and_byte_by_byte_padded_or_not_with_their_payloads():
    seal, decoder = _sealed_pair()
    payload = os.urandom(2 * PADDED_PAYLOAD_BYTES_MIN)
    plain = encode_frame(GetReplicaList(["a", "b"]), 1, seal=seal)
    padded = encode_frame(ReadReply(len(payload)), 2, is_reply=True, payload_size=len(payload),
                          payload_source=16, seal=seal)  # fmt: skip
    tag = payload_tag(seal.payload_mac(), [payload[:100], payload[100:]])
    assert len(tag) == limits.PAYLOAD_TAG_SIZE_BYTES
    assert _flags(plain) & FLAG_SEALED and _flags(padded) & FLAG_SEALED and _flags(padded) & FLAG_PADDED
    assert not is_slow_copy(16, len(padded)), "the padding counts the tag"
    sink = bytearray(len(payload))
    events = []
    wire = plain + padded + payload + tag
    for byte in wire[:-1]:
        decoder.receive_data(bytes([byte]))
        events += drain(decoder, lambda frame: [memoryview(sink)])
    assert events == [
        Frame(1, False, GetReplicaList(["a", "b"]), 0),
        Frame(2, True, ReadReply(len(payload)), len(payload)),
    ]
    decoder.receive_data(wire[-1:])  # the payload is done once its tag is in, and holds
    assert drain(decoder) == [PayloadDone(2)]
    assert sink == payload


@pytest.mark.parametrize("sinks", ["direct", "staged", "discarded"])
def test_a_sealed_payload_changed_on_the_way_is_refused_before_it_is_done(sinks):
    """Payload bytes are not in the frame's tag but in their own, after them: a payload a relay
    changed (xxh3 checksums can be forged to match) fails it, landed straight in a sink,
    through the staging buffer, or discarded, and no PayloadDone lets anyone act on it."""
    size = 2 * DIRECT_SINK_BYTES_MIN
    for changed in (False, True):
        seal, decoder = _sealed_pair()
        header = encode_frame(ReadReply(size), 7, is_reply=True, payload_size=size, seal=seal)
        payload = bytearray(os.urandom(size))
        tag = payload_tag(seal.payload_mac(), [payload])
        if changed:
            payload[size // 2] ^= 0x01
        sink = bytearray(size)
        decoder.receive_data(header)
        assert drain(decoder, lambda frame: None if sinks == "discarded" else [memoryview(sink)]) == [
            Frame(7, True, ReadReply(size), size)
        ]
        if sinks == "direct":  # as a socket's recv_into does
            view = decoder.get_buffer()
            assert len(view) == size, "the sink itself"
            view[:] = payload
            view.release()
            decoder.buffer_updated(size)
            decoder.receive_data(tag)
        else:
            decoder.receive_data(bytes(payload) + tag)
        if changed:
            with pytest.raises(RemoteProtocolError, match="payload whose tag does not hold"):
                drain(decoder)
        else:
            assert drain(decoder) == [PayloadDone(7)]


def _refused(decoder: FrameDecoder, wire: bytes, why: str) -> None:
    decoder.receive_data(wire)
    with pytest.raises(RemoteProtocolError, match=why):
        drain(decoder)


@pytest.mark.parametrize("position", [6, limits.FRAME_HEADER_SIZE_BYTES + 2, -1], ids=["header", "message", "tag"])
def test_a_sealed_frame_changed_anywhere_is_refused(position):
    seal, decoder = _sealed_pair()
    wire = bytearray(encode_frame(GetReplicaList(["key"]), 1, seal=seal))
    wire[position] ^= 0x01
    _refused(decoder, bytes(wire), "does not hold")


def test_a_sealed_frame_replayed_reordered_or_from_another_key_is_refused():
    seal, replayed = _sealed_pair()
    first = encode_frame(GetReplicaList(["a"]), 1, seal=seal)
    replayed.receive_data(first)
    assert len(drain(replayed)) == 1
    _refused(replayed, first, "does not hold")

    seal, reordered = _sealed_pair()
    encode_frame(GetReplicaList(["a"]), 1, seal=seal)  # the first, dropped on the way
    _refused(reordered, encode_frame(GetReplicaList(["b"]), 2, seal=seal), "does not hold")

    _, stranger = _sealed_pair()
    _refused(stranger, encode_frame(GetReplicaList(["a"]), 1, seal=FrameSeal(os.urandom(32))), "does not hold")


def test_a_frame_without_its_tag_after_the_handshake_or_with_one_before_is_refused():
    seal, sealed = _sealed_pair()
    _refused(sealed, encode_frame(GetReplicaList(["a"]), 1), "without its tag")
    _refused(FrameDecoder(), encode_frame(GetReplicaList(["a"]), 1, seal=seal), "before the handshake")
    short = _header(flags=FLAG_SEALED, control=3) + b"\x92\x3e\x00"  # a ReadReply(0) without room for a tag
    _, too_short = _sealed_pair()
    _refused(too_short, short, "too short")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_sealed_frames_are_refused_unless_unchanged(data):
    seal, decoder = _sealed_pair()
    original = encode_frame(PutStart(["k1", "k2"], [10, 20], ReplicateConfig()), 5, seal=seal)
    wire = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    decoder.receive_data(bytes(wire))
    try:
        events = drain(decoder)
    except RemoteProtocolError:
        return
    assert wire == original or events == [], "a changed frame was taken"


def test_buffer_address_of_writable_read_only_sliced_and_empty_buffers():
    array = np.zeros(100, dtype=np.uint8)
    start = array.ctypes.data
    assert buffer_address(memoryview(array)) == start
    assert buffer_address(memoryview(array)[37:]) == start + 37
    data = bytes(range(50))
    assert buffer_address(memoryview(data)[7:]) - buffer_address(data) == 7
    assert buffer_address(memoryview(array)[100:]) == start + 100  # empty: no error
    assert buffer_address(b"") > 0


_address = st.none() | st.integers(0, 2 * PAGE_BYTES) | st.integers(0, 1 << 47)


@settings(max_examples=1000, deadline=None)
@given(st.integers(limits.FRAME_HEADER_SIZE_BYTES, 1 << 20), _address, _address)
@example(27, 0, 80)  # the first padding that suits the send leaves the receive slow
@example(27, 80, 0)
def test_padding_keeps_both_copies_fast_with_the_least_bytes(header_bytes, source, landing):
    def fast(start: int) -> bool:
        return not (source is not None and is_slow_copy(source, start)) and not (
            landing is not None and is_slow_copy(start, landing)
        )

    padding = payload_padding(header_bytes, source, landing)
    assert 0 <= padding <= PADDING_BYTES_MAX
    assert fast(header_bytes + padding)  # two ranges of 63 slow offsets leave room in 256
    assert not any(fast(header_bytes + fewer) for fewer in range(padding))


def _header(magic=limits.FRAME_MAGIC, version=limits.FRAME_VERSION, flags=0, rid=1, control=0, payload=0):
    return struct.pack(limits.FRAME_HEADER_FMT, magic, version, flags, rid, control, payload)


@pytest.mark.parametrize(
    "wire",
    [
        _header(magic=0xDEAD),
        _header(version=9),
        _header(flags=0x80),
        _header(control=limits.FRAME_CONTROL_SIZE_BYTES_MAX + 1),
        _header(payload=limits.FRAME_PAYLOAD_SIZE_BYTES_MAX + 1),
        _header(control=3) + b"\xff\xff\xff",  # not msgpack
        _header(control=3) + b"\x92\x7f\x00",  # unknown message tag 127
        _header(flags=1, control=len(b"\x92\x0e\x90")) + b"\x92\x0e\x90",  # request flagged as reply
    ],
    ids=["magic", "version", "flags", "huge-control", "huge-payload", "garbage", "unknown-tag", "flag"],
)
def test_malformed_frames_raise_remote_protocol_error(wire):
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    with pytest.raises(RemoteProtocolError):
        drain(decoder)


def test_truncated_frame_waits_for_more():
    wire = encode_frame(GetReplicaList(["k"]), 1)
    decoder = FrameDecoder()
    decoder.receive_data(wire[:-1])
    assert decoder.next_event() is NEED_DATA


def test_control_message_larger_than_staging_buffer():
    keys = [f"{i:064d}" for i in range(10_000)]  # ~700 KB of control message
    wire = encode_frame(GetReplicaList(keys), 1)
    assert len(wire) > 256 * 1024
    decoder = FrameDecoder()
    for start in range(0, len(wire), 65536):
        decoder.receive_data(wire[start : start + 65536])
    assert drain(decoder)[0].message.keys == keys


def test_a_control_message_larger_than_the_buffer_is_copied_a_bounded_number_of_times(monkeypatch):
    """Every receive of a frame larger than the staging buffer compacted it, copying all it
    had received so far: quadratic, a batch of 16,384 keys of 4 KiB (64 MiB) took 3-5 s to
    reach the master and timed out. The bytes are now moved at most a few times in all."""
    from kvpool.protocol import frames

    copied = [0]

    class CountedBytearray(bytearray):  # the staging buffers: what slices of them copy
        def __getitem__(self, key):
            item = super().__getitem__(key)
            copied[0] += len(item) if isinstance(key, slice) else 0
            return item

        def __setitem__(self, key, value):
            copied[0] += len(value) if isinstance(key, slice) else 0
            super().__setitem__(key, value)

    keys = [f"{i:08d}".ljust(1024, "k") for i in range(4096)]  # ~4 MiB of control message
    wire = encode_frame(GetReplicaList(keys), 1)
    monkeypatch.setattr(frames, "bytearray", CountedBytearray, raising=False)
    decoder = FrameDecoder()
    for start in range(0, len(wire), 200_000):  # what a Unix socket hands over per receive
        decoder.receive_data(wire[start : start + 200_000])
    assert drain(decoder)[0].message.keys == keys
    assert isinstance(decoder._staging, CountedBytearray)
    assert copied[0] <= 4 * len(wire), (copied[0], len(wire))


# The most items a reply may make its receiver decode along a path of containers: a batch of
# keys with REPLICAS_PER_OBJECT_MAX replicas each (GetReplicaListReply), which decoded in ~0.1 s
# and ~35 MB here. A request holds a batch at most.
REPLY_ITEMS_MAX = 1 << 20

_SEQUENCES = (msgspec.inspect.ListType, msgspec.inspect.SetType, msgspec.inspect.FrozenSetType,
              msgspec.inspect.VarTupleType)  # fmt: skip


def _unbounded_containers(info, path: str, items_max: int, items_around: int = 1) -> Iterator[str]:
    """The containers below `info` (msgspec.inspect) that could make a message's receiver
    decode more than `items_max` items: one with no bound, or whose bound times the bounds of
    the containers around it is more (a bounded list of bounded lists multiplies them)."""
    if isinstance(info, (*_SEQUENCES, msgspec.inspect.DictType)):
        if info.max_length is None:
            yield f"{path}: unbounded"
            return
        items = items_around * info.max_length
        if items > items_max:
            yield f"{path}: {items} items at most"
        inner = (info.item_type,) if isinstance(info, _SEQUENCES) else (info.key_type, info.value_type)
        for item in inner:
            yield from _unbounded_containers(item, f"{path}[]", items_max, items)
    elif isinstance(info, (msgspec.inspect.TupleType, msgspec.inspect.UnionType)):
        for item in info.item_types if isinstance(info, msgspec.inspect.TupleType) else info.types:
            yield from _unbounded_containers(item, f"{path}()", items_max, items_around)
    elif isinstance(info, msgspec.inspect.StructType):
        for field in info.fields:
            yield from _unbounded_containers(field.type, f"{path}.{field.name}", items_max, items_around)


def test_no_message_holds_more_items_than_its_bound():
    """A message is decoded before anyone looks at it, on the receiver's loop: a 64 MiB
    control message of a list of lists (ReleaseLeases) or of an unbounded dict (Heartbeat)
    held 15 million keys, and a master's loop for 6-7 s at 1.2 GB (review helper-56). A reply
    too: one sent unasked is decoded before its receiver finds no request waiting for it, and
    a PutStartReply of 24 million empty placement lists held a master's loop for 11 s at
    1.7 GB. Every list and dict of a request holds a batch at most, nested or not; a reply's
    hold what a legitimate answer may, and together at most REPLY_ITEMS_MAX."""
    kinds = [
        cls
        for cls in vars(messages).values()
        if isinstance(cls, type) and issubclass(cls, messages.Message) and cls is not messages.Message
    ]
    replies = [cls for cls in kinds if issubclass(cls, messages.REPLY_TYPES)]
    assert len(kinds) > 35 and len(replies) > 10
    found = [
        problem
        for cls in kinds
        for problem in _unbounded_containers(
            msgspec.inspect.type_info(cls),
            cls.__name__,
            REPLY_ITEMS_MAX if issubclass(cls, messages.REPLY_TYPES) else limits.BATCH_KEYS_MAX,
        )
    ]
    assert found == []


def test_a_reply_over_its_bound_is_refused_before_its_items_are_decoded():
    """The frame the review sent unasked, smaller: refused by the decoder at its outer list's
    length (a legitimate reply of the most a put_start answers still decodes)."""
    attack = encode_frame(PutStartReply([], [[]] * 2_000_000, [], {}), 9, is_reply=True)
    decoder = FrameDecoder()
    decoder.receive_data(attack)
    with pytest.raises(RemoteProtocolError, match=f"length <= {limits.BATCH_KEYS_MAX}"):
        decoder.next_event()
    grant = WriteGrant("s", 0, 4096, 1)
    most = PutStartReply(
        [0] * limits.BATCH_KEYS_MAX,
        [[(0, 0)] * limits.REPLICA_NUM_MAX] * limits.BATCH_KEYS_MAX,
        [grant] * (limits.BATCH_KEYS_MAX * limits.REPLICA_NUM_MAX),
        {},
    )
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(most, 9, is_reply=True))
    assert drain(decoder)[0].message == most


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_only_ever_raise_remote_protocol_error(data):
    decoder = FrameDecoder()
    decoder.receive_data(data)
    try:
        drain(decoder)
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_frames_only_ever_raise_remote_protocol_error(data):
    wire = bytearray(encode_frame(PutStart(["k1", "k2"], [10, 20], ReplicateConfig()), 5))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(wire) - 1))
        wire[position] = data.draw(st.integers(0, 255))
    decoder = FrameDecoder()
    decoder.receive_data(bytes(wire))
    try:
        drain(decoder)
    except RemoteProtocolError:
        pass


def test_a_frame_larger_than_the_staging_buffer_while_the_transport_holds_its_view() -> None:
    """uvloop holds the view get_buffer returned until buffer_updated has returned, and a
    Connection decodes inside buffer_updated: the decoder must never resize its staging
    buffer while that view is alive (an exported bytearray cannot be resized). A control
    message of hundreds of KiB (a drop of thousands of objects) arrives in many reads."""
    keys = [f"key-{i:060d}" for i in range(8000)]
    frame = encode_frame(GetReplicaList(keys), 7)
    decoder = FrameDecoder()
    events = []
    position = 0
    while position < len(frame):
        view = decoder.get_buffer()  # held across buffer_updated and next_event, as uvloop does
        size = min(len(view), len(frame) - position, 64 * 1024)
        view[:size] = frame[position : position + size]
        position += size
        decoder.buffer_updated(size)
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
        view.release()
    assert len(events) == 1 and events[0].message == GetReplicaList(keys) and events[0].request_id == 7


def test_a_header_announcing_a_large_control_message_buys_memory_only_as_its_bytes_come():
    """A 21-byte header announcing 64 MiB made a server allocate 64 MiB at once, even before
    the handshake (fuzzing: +640 MiB from ten connections). The buffer grows as the bytes come,
    and lets the room go once the frame is over."""
    from kvpool.protocol.messages import ExistKeys

    keys = [f"{i:0250d}" for i in range(16_384)]
    frame = encode_frame(ExistKeys(keys), 7)  # a control message of some 4 MiB
    decoder = FrameDecoder()
    initial = len(decoder.get_buffer())
    decoder.receive_data(frame[:64])
    assert len(decoder._staging) <= 2 * initial
    fed = 64
    while fed < len(frame):
        decoder.receive_data(frame[fed : fed + 256 * 1024])
        fed += 256 * 1024
        assert len(decoder._staging) <= 2 * min(fed, len(frame)) + initial
    event = decoder.next_event()
    assert isinstance(event, Frame) and event.message.keys == keys
    assert decoder.next_event() is NEED_DATA
    assert len(decoder.get_buffer()) == initial  # the large room is let go


def test_the_buffer_grows_while_a_view_of_it_is_still_held():
    """uvloop keeps the buffer of a receive that brought nothing until it asks for the next:
    growing the staging buffer in place then raised BufferError, and the connection died."""
    from kvpool.protocol.messages import ExistKeys

    keys = [f"{i:0100d}" for i in range(5_000)]
    frame = encode_frame(ExistKeys(keys), 3)  # larger than the staging buffer
    decoder = FrameDecoder()
    held = decoder.get_buffer()
    held[:] = frame[: len(held)]
    decoder.buffer_updated(len(held))  # full, the view still held
    fed = len(held)
    room = decoder.get_buffer()  # grows
    assert len(room) > 0
    room[: len(frame) - fed] = frame[fed:][: len(room)]
    decoder.buffer_updated(min(len(room), len(frame) - fed))
    fed += min(len(room), len(frame) - fed)
    decoder.receive_data(frame[fed:])
    event = decoder.next_event()
    assert isinstance(event, Frame) and event.message.keys == keys
    assert bytes(held[:16]) == frame[:16]  # the old view is left as it was
