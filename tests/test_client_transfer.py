"""The client's pure transfer planning: how objects are cut into items and frames. Checked by
reassembling what the frames would carry and comparing with the objects, with the slice and
frame sizes shrunk so that every boundary case appears with small buffers."""

from __future__ import annotations

import os

import pytest

from kvpool import limits
from kvpool.client import transfer
from kvpool.client.transfer import _FrameCutter
from kvpool.protocol.messages import PutStartReply, SegmentInfo, WriteGrant, WriteItem, WriteSlices


@pytest.mark.parametrize("slice_bytes,frame_bytes", [(64, 128), (1000, 10_000), (7, 7)])
def test_frames_carry_each_object_contiguously_across_its_buffers(monkeypatch, slice_bytes, frame_bytes):
    monkeypatch.setattr(limits, "SLICE_SIZE_BYTES_MAX", slice_bytes)
    monkeypatch.setattr(transfer, "FRAME_BYTES_TARGET", frame_bytes)
    objects = {
        0: [os.urandom(100)],
        1: [os.urandom(30), os.urandom(0), os.urandom(250), os.urandom(1)],  # one per layer
        2: [os.urandom(64)],
    }
    cutter = _FrameCutter("n:1", WriteItem, WriteSlices)
    grants = {i: WriteGrant("s", 10_000 * i, sum(map(len, parts)), 0) for i, parts in objects.items()}
    for index, parts in objects.items():
        cutter.add(index, grants[index], [memoryview(p) for p in parts])
    batch = cutter.finish()
    rebuilt = {i: bytearray(g.size) for i, g in grants.items()}
    for (message, views), owners in zip(batch.frames, batch.owners):
        payload = b"".join(bytes(v) for v in views)
        position = 0
        assert len(message.items) == len(owners)
        for item, owner in zip(message.items, owners):
            assert 0 < item.size <= slice_bytes
            assert item.grant is grants[owner]
            rebuilt[owner][item.start : item.start + item.size] = payload[position : position + item.size]
            position += item.size
        assert position == len(payload)
    assert {i: bytes(b) for i, b in rebuilt.items()} == {i: b"".join(p) for i, p in objects.items()}


@pytest.mark.parametrize("second_key_first_on", ["A", "B"])
def test_a_put_names_the_segments_it_hashed_in_place(second_key_first_on: str) -> None:
    """PutEnd.hashed_in_place lists a segment only if every key written there was hashed as it
    landed: a second same-host replica is copied from the first, not hashed where it lands."""
    class Mapped:
        def __init__(self) -> None:
            self.data = memoryview(bytearray(8192))

    segments = {sid: SegmentInfo(sid, "n", "h", "h:1", "/dev/shm/x", b"t", 8192) for sid in "AB"}
    mapped = {sid: Mapped() for sid in "AB"}
    first_of_second = 0 if second_key_first_on == "A" else 1
    reply = PutStartReply(
        [0, 0],
        [[(0, 0), (1, 0)], [(first_of_second, 4096), (1 - first_of_second, 4096)]],
        [WriteGrant("A", 0, 8192, 0), WriteGrant("B", 0, 8192, 0)],
        segments,
    )
    values = [os.urandom(4096), os.urandom(4096)]
    parts = [[memoryview(v)] for v in values]
    job = transfer.PutJob(["k0", "k1"], parts, reply, lambda info: mapped[info.segment_id])
    job.copy_local()
    for sid in "AB":
        assert bytes(mapped[sid].data) == values[0] + values[1]
    assert job.hashed_in_place == (["A"] if second_key_first_on == "A" else [])


def test_new_bytes_lands_payload_in_the_object_returned() -> None:
    """A plain get's payload lands straight in the bytes object it returns; the view keeps the
    object alive, and small sizes (tiny ones above all: CPython shares those objects) land in
    a bytearray instead."""
    import gc
    import os

    from kvpool.client.transfer import _landing, _new_bytes

    payload = os.urandom(1 << 20)
    data, view = _new_bytes(len(payload))
    view[:] = payload
    assert type(data) is bytes and data == payload and hash(data) == hash(payload)
    del data
    gc.collect()
    assert bytes(view) == payload  # still alive through the view
    for size in (0, 1, 2, 4096, (16 << 10) + 1):  # small ones land in a bytearray
        small, small_view = _landing(size)
        small_view[:] = b"\x07" * size
        assert small == b"\x07" * size
    assert b"" == bytes() and len(b"") == 0
