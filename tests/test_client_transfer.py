"""The client's pure transfer planning: how objects are cut into items and frames. Checked by
reassembling what the frames would carry and comparing with the objects, with the slice and
frame sizes shrunk so that every boundary case appears with small buffers."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from kvpool import limits, page_advice
from kvpool.client import transfer
from kvpool.client.transfer import _FrameCutter, _LandingHasher, _read_item, _read_slices, _write_slices
from kvpool.protocol.messages import PutStartReply, Replica, SegmentInfo, WriteGrant


@pytest.mark.parametrize("slice_bytes,frame_bytes", [(64, 128), (1000, 10_000), (7, 7)])
def test_frames_carry_each_object_contiguously_across_its_buffers(monkeypatch, slice_bytes, frame_bytes):
    monkeypatch.setattr(limits, "SLICE_SIZE_BYTES_MAX", slice_bytes)
    monkeypatch.setattr(transfer, "FRAME_BYTES_TARGET", frame_bytes)
    objects = {
        0: [os.urandom(100)],
        1: [os.urandom(30), os.urandom(0), os.urandom(250), os.urandom(1)],  # one per layer
        2: [os.urandom(64)],
    }
    cutter = _FrameCutter("n:1", transfer._write_item, _write_slices, transfer._joined_write)
    grants = {i: WriteGrant("s", 10_000 * i, sum(map(len, parts)), 0) for i, parts in objects.items()}
    for index, parts in objects.items():
        cutter.add(index, (grants[index], 0), [memoryview(p) for p in parts])
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
    job = transfer.PutJob(["k0", "k1"], parts, reply, lambda info: mapped[info.segment_id], put_id=1)
    job.copy_local()
    for sid in "AB":
        assert bytes(mapped[sid].data) == values[0] + values[1]
    assert job.hashed_in_place == (["A"] if second_key_first_on == "A" else [])


@pytest.mark.parametrize("slice_bytes", [1 << 20, 3 * 4096])
def test_the_keys_of_a_run_go_to_the_node_as_one_item(monkeypatch, slice_bytes: int) -> None:
    """Keys that follow each other under one grant (a run, master/puts.py) are written as one
    item, up to a slice; a key after a gap, under another grant or to another node starts a
    new one. What the node lands by the items is every key's bytes at its place."""
    monkeypatch.setattr(limits, "SLICE_SIZE_BYTES_MAX", slice_bytes)
    page = 4096
    segments = {s: SegmentInfo(s, f"node-{s}", "elsewhere", f"{s}:1", "", b"t", 1 << 20) for s in "AB"}
    run, other = WriteGrant("A", 8 * page, 8 * page, 0), WriteGrant("A", 64 * page, page, 0)
    elsewhere = WriteGrant("B", 0, 2 * page, 0)
    placements = [(run, 0), (run, page), (run, 2 * page), (run, 3 * page), (run, 5 * page),  # gap
                  (other, 0), (elsewhere, 0), (elsewhere, page), (run, 6 * page)]  # fmt: skip
    grants = [run, other, elsewhere]
    reply = PutStartReply(
        [0] * len(placements), [[(grants.index(g), start)] for g, start in placements], grants, segments
    )
    values = [os.urandom(page) for _ in placements]
    job = transfer.PutJob([f"k{i}" for i in range(len(values))], [[memoryview(v)] for v in values], reply,
                          lambda info: None, put_id=1)  # fmt: skip
    landed = {s: bytearray(1 << 20) for s in "AB"}
    spans = {}
    for batch in job.remote:
        for (message, views), owners in zip(batch.frames, batch.owners):
            payload = b"".join(bytes(v) for v in views)
            position = 0
            for item in message.items:
                assert 0 < item.size <= slice_bytes and item.start + item.size <= item.grant.size
                at = item.grant.offset + item.start
                landed[item.grant.segment_id][at : at + item.size] = payload[position : position + item.size]
                position += item.size
            assert position == len(payload)
            spans[batch.endpoint] = spans.get(batch.endpoint, []) + [
                (i.grant.offset + i.start, i.size) for i in message.items
            ]
    for (grant, start), value in zip(placements, values):
        at = grant.offset + start
        assert bytes(landed[grant.segment_id][at : at + page]) == value
    if slice_bytes > 8 * page:  # keys 0-3 one item, 4 alone (a gap before), 5 another grant, 8 after it
        assert spans["A:1"] == [(8 * page, 4 * page), (13 * page, page), (64 * page, page), (14 * page, page)]
    else:  # a slice holds three pages: the run of four is cut after the third
        assert spans["A:1"][:2] == [(8 * page, 3 * page), (11 * page, page)]
    assert spans["B:1"] == [(0, 2 * page)]


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_reads_of_objects_that_follow_each_other_in_a_segment_are_one_item(tier: str) -> None:
    """A get of pages put together (one run) asks a node's DRAM for one range per run, and
    each page still lands in its own bytes; a disk tier (a file per object) is asked for each
    object on its own."""
    import xxhash

    from kvpool.protocol.messages import GetReplicaListReply, Replica

    page = 4096
    infos = {"A": SegmentInfo("A", "node-A", "elsewhere", "A:1", "", b"t", 1 << 20, tier)}
    offsets = [0, page, 2 * page, 10 * page, 11 * page]
    stored = bytearray(1 << 20)
    values = [os.urandom(page) for _ in offsets]
    for offset, value in zip(offsets, values):
        stored[offset : offset + page] = value
    reply = GetReplicaListReply(
        [0] * len(values), [page] * len(values), [xxhash.xxh3_64_intdigest(v) for v in values],
        [[Replica("A", offset)] for offset in offsets], 10_000, infos,
    )  # fmt: skip
    job = transfer.GetJob(reply, [None] * len(values), 0, lambda info: None, [f"k{i}" for i in range(len(values))])
    job.copy_local()
    (batch,) = job.remote_batches()
    ((message, sinks),) = batch.frames
    asked = [(i.offset, i.size) for i in message.items]
    assert asked == ([(0, 3 * page), (10 * page, 2 * page)] if tier == "dram" else [(o, page) for o in offsets])
    payload = b"".join(bytes(stored[i.offset : i.offset + i.size]) for i in message.items)
    (sink,) = sinks
    sink[:] = payload
    job.remote_done(set(batch.owners[0]), set())
    job.finish(1)
    assert job.results == values


def test_new_bytes_lands_payload_in_the_object_returned() -> None:
    """A plain get's payload lands straight in the bytes object it returns; the view keeps the
    object alive."""
    import gc
    import os

    from kvpool.client.transfer import _new_bytes

    payload = os.urandom(1 << 20)
    data, view = _new_bytes(len(payload))
    view[:] = payload
    assert type(data) is bytes and data == payload and hash(data) == hash(payload)
    del data
    gc.collect()
    assert bytes(view) == payload  # still alive through the view
    assert b"" == bytes() and len(b"") == 0


def test_plain_gets_of_pages_land_in_one_buffer_per_frame(monkeypatch) -> None:
    """Plain gets of small objects over TCP: each frame's payload lands in one buffer (one
    receive), objects of both nodes come back whole and in order, a page whose bytes do not
    hash to its checksum is a miss that names its replica, and larger objects and zero-copy
    targets still get their own sinks."""
    import xxhash

    from kvpool.protocol.messages import GetReplicaListReply, ReadSlices, Replica

    monkeypatch.setattr(transfer, "FRAME_BYTES_TARGET", 10_000)  # pages span several frames
    infos = {s: SegmentInfo(s, f"node-{s}", "elsewhere", f"{s}:1", "", b"t", 1 << 20) for s in "AB"}
    page = transfer.SMALL_LANDING_BYTES_MAX
    sizes = [4096, 1, page, 4096, page + 1, 4096, 3000, 4096]
    values = [os.urandom(n) for n in sizes]
    stored = {"A": bytearray(1 << 20), "B": bytearray(1 << 20)}  # what the nodes hold
    replicas = []
    for index, value in enumerate(values):
        segment_id = "AB"[index % 2]
        offset = 40_000 * index
        stored[segment_id][offset : offset + len(value)] = value
        replicas.append([Replica(segment_id, offset)])
    checksums = [xxhash.xxh3_64_intdigest(v) for v in values]
    stored["B"][40_000 * 3] ^= 0xFF  # key 3's only replica rotted
    reply = GetReplicaListReply([0] * len(values), sizes, checksums, replicas, 10_000, infos)
    zero_copy = bytearray(4096)
    targets = [None] * len(values)
    targets[6] = [memoryview(zero_copy)]
    keys = [f"k{i}" for i in range(len(values))]
    job = transfer.GetJob(reply, targets, 0, lambda info: None, keys)
    job.copy_local()  # nothing is mapped here
    batches = job.remote_batches()
    assert sorted(b.endpoint for b in batches) == ["A:1", "B:1"]
    asked = set()
    for batch in batches:
        for (message, sinks), owners in zip(batch.frames, batch.owners):
            assert isinstance(message, ReadSlices) and len(message.items) == len(owners)
            payload = b"".join(bytes(stored[i.segment_id][i.offset : i.offset + i.size]) for i in message.items)
            assert sum(len(s) for s in sinks) == len(payload)
            if all(targets[o] is None and sizes[o] <= page for o in owners):
                assert len(sinks) == 1  # a frame of pages: one buffer
            position = 0
            for sink in sinks:
                sink[:] = payload[position : position + len(sink)]
                position += len(sink)
            asked |= set(owners)
    assert asked == set(range(len(values)))
    job.remote_done(asked, set())
    job.finish(1)
    for index, value in enumerate(values):
        if index == 3:
            assert job.codes[index] != 0 and job.results[index] is None
        elif index == 6:
            assert job.results[index] == len(value) and bytes(zero_copy[: len(value)]) == value
        else:
            assert job.codes[index] == 0 and type(job.results[index]) is bytes and job.results[index] == value
    assert job.bad_replicas == [("k3", Replica("B", 40_000 * 3))]


def test_reply_sinks_that_follow_each_other_in_registered_memory_are_received_as_one() -> None:
    """A zero-copy get's sinks merge where the objects' buffers follow each other in one
    registered buffer; a gap, a multi-part object, an unknown address or the seam between two
    registered buffers keeps them apart. Filling the merged sinks fills every object."""
    import numpy as np

    from kvpool.client.buffers import BufferRegistry
    from kvpool.protocol.messages import ReadItem, Replica

    registry = BufferRegistry()
    memory = np.zeros(64 * 1024, dtype=np.uint8)
    first = registry.register(memory[: 32 * 1024])
    second = registry.register(memory[32 * 1024 :])
    assert second == first + 32 * 1024  # back to back: a view spans one of them only
    page = 4096
    layout = [  # (address or None, parts): the object's buffers
        (first, 1), (first + page, 1), (first + 2 * page, 1),  # a run of three
        (first + 4 * page, 1),  # a gap before it
        (None, 2),  # two parts (one per layer): never merged
        (first + 7 * page, 1), (second, 1),  # follow on, but across the seam
    ]  # fmt: skip
    def read_item(replica: Replica, start: int, size: int) -> ReadItem:
        return ReadItem("s", replica.offset + start, size)

    join = transfer._read_joiner({"s": SegmentInfo("s", "n", "h", "h:1", "", b"t", 1 << 20)})
    cutter = _FrameCutter("n:1", read_item, _read_slices, join, registry.view)
    scratch = []
    for index, (address, parts) in enumerate(layout):
        if address is None:
            views = [memoryview(bytearray(page // 2)) for _ in range(parts)]
            scratch.append(views)
        else:
            views = [registry.view(address, page)]
        cutter.add(index, Replica("s", index * page), views, address)
    (message, sinks), = cutter.finish().frames
    assert [len(s) for s in sinks] == [3 * page, page, page // 2, page // 2, page, page]
    payload = os.urandom(len(layout) * page)
    position = 0
    for sink in sinks:
        sink[:] = payload[position : position + len(sink)]
        position += len(sink)
    for index, (address, _) in enumerate(layout):
        want = payload[index * page : (index + 1) * page]
        got = b"".join(bytes(v) for v in scratch[0]) if address is None else bytes(registry.view(address, page))
        assert got == want, index


def test_large_plain_get_landings_ask_for_huge_pages_inside_their_bytes_only(monkeypatch) -> None:
    """A bytes object of at least HUGE_PAGES_BYTES_MIN asks for transparent huge pages on the
    whole 2 MiB pages inside its own data, never past it; smaller ones ask nothing. The bytes
    land whole either way."""
    calls = []
    monkeypatch.setattr(page_advice, "_madvise", lambda start, length, advice: calls.append((start, length, advice)))
    huge = 2 << 20
    for size in (page_advice.HUGE_PAGES_BYTES_MIN - 1, page_advice.HUGE_PAGES_BYTES_MIN, 32 << 20, (32 << 20) + 12345):
        calls.clear()
        data, view = transfer._new_bytes(size)
        address = id(data) + transfer._BYTES_DATA_OFFSET
        if size < page_advice.HUGE_PAGES_BYTES_MIN:
            assert calls == []
            continue
        (start, length, advice), = calls
        assert advice == 14 and start % huge == 0 and length % huge == 0 and length > 0
        assert address <= start and start + length <= address + size
        assert start - address < huge and address + size - (start + length) < huge  # every whole page
        payload = os.urandom(size)
        view[:] = payload
        assert data == payload


def test_a_round_of_reads_keeps_time_for_the_next_replicas_within_the_lease():
    """A node that stops answering must leave the next replica time to be read within the read
    lease (a get waited out a 30 s transfer timeout and missed); a busy but healthy node keeps
    most of the lease; a lapsed lease reads nothing (a 1 ms round marked healthy nodes slow)."""
    from kvpool.protocol.messages import GetReplicaListReply, Replica

    infos = {s: SegmentInfo(s, f"node-{s}", "elsewhere", f"{s}:1", "", b"t", 1 << 20) for s in "ABC"}

    def job(replica_count: int, lease_ms: int) -> transfer.GetJob:
        replicas = [[Replica(s, 0) for s in "ABC"[:replica_count]]]
        reply = GetReplicaListReply([0], [4096], [1], replicas, lease_ms, infos)
        return transfer.GetJob(reply, [None], 0, lambda info: None, ["k"])

    reserve = transfer.READ_FALLBACK_RESERVE_MS
    assert job(1, 10_000).round_timeout_ms(0, 30_000) == 10_000  # one replica: the whole lease
    assert job(2, 10_000).round_timeout_ms(0, 30_000) == 10_000 - reserve
    assert job(3, 10_000).round_timeout_ms(0, 30_000) == 10_000 - 2 * reserve
    assert job(2, 10_000).round_timeout_ms(9_000, 30_000) == 500  # a lease nearly spent: halves
    assert job(2, 10_000).round_timeout_ms(0, 3_000) == 3_000  # the transfer timeout bounds it
    assert job(2, 10_000).round_timeout_ms(10_001, 30_000) == 0  # lapsed: nothing to read for


def test_put_ids_differ_even_when_the_application_seeds_random() -> None:
    """vLLM seeds Python's `random` to 0 in every worker: ids drawn from it were the same
    sequence in every instance, and a stalled writer's late put_end could again end another
    writer's put of the same key."""
    import random

    ids = []
    for _ in range(2):
        random.seed(0)
        ids.append(transfer.new_put_id())
    assert ids[0] != ids[1] and all(put_id > 0 for put_id in ids)


@pytest.mark.parametrize("seed", range(20))
def test_a_read_frame_is_hashed_as_it_lands_for_each_object_wholly_in_it(monkeypatch, seed):
    """A get over TCP hashes each object as its bytes land (_LandingHasher, fed what the
    FrameDecoder lands, in pieces of any size): every object whose bytes are all in one frame
    gets the checksum of exactly its bytes; an object cut into several items (larger than a
    slice) gets none there, and is hashed once it is whole, as before."""
    monkeypatch.setattr(limits, "SLICE_SIZE_BYTES_MAX", 300)
    monkeypatch.setattr(transfer, "FRAME_BYTES_TARGET", 700)
    rng = random.Random(seed)
    objects = [rng.randbytes(rng.choice([1, 50, 299, 300, 301, 900])) for _ in range(12)]
    cutter = _FrameCutter("n:1", _read_item, _read_slices, lambda *_: False)
    for index, data in enumerate(objects):
        cutter.add(index, Replica("s", 10_000 * index), [memoryview(bytearray(len(data)))])
    batch = cutter.finish()
    sums: dict[int, int] = {99: 0}  # the sum of a key not in these frames is left alone
    for owners, item_bytes in zip(batch.owners, batch.item_bytes):
        hasher = _LandingHasher(owners, item_bytes, [len(o) for o in objects], sums)
        taken = {index: 0 for index in owners}
        payload = bytearray()
        for index, size in zip(owners, item_bytes):  # each item's bytes, in order
            payload += objects[index][taken[index] : taken[index] + size]
            taken[index] += size
        view = memoryview(bytes(payload))
        while view:
            cut = rng.randint(1, 400)
            hasher(view[:cut])
            view = view[cut:]
    whole = {i for i, data in enumerate(objects) if len(data) <= 300}
    assert sums.pop(99) == 0
    assert sums == {i: xxhash.xxh3_64_intdigest(objects[i]) for i in whole}
