"""A Store opened before the process forks (multiprocessing's default start method on Linux,
as serving engines' worker pools use it) works in the child, and the parent's Store keeps
every connection it had: the child opens its own and never touches the parent's."""

from __future__ import annotations

import multiprocessing
import os
import threading

import numpy as np
import pytest

from kvpool import ErrorCode, Store
from kvpool.errors import InvalidRequest

JOIN_TIMEOUT_S = 60.0
BIG = 20 << 20  # several frames over TCP (through the loop); copied on two threads same-host
PAGE = 64 << 10
KEYS = 32
ROUNDS = 20


def _in_child(body, store: Store, *args, meanwhile=lambda: None) -> dict:
    """Run body(store, *args) in a forked child while this process runs meanwhile(); the
    child's result or its error, as a dict."""
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()

    def child() -> None:
        try:
            theirs.send({"result": body(store, *args)})
        except BaseException as exc:
            theirs.send({"error": f"{type(exc).__name__}: {exc}"})

    process = fork.Process(target=child, daemon=True)
    process.start()
    try:
        meanwhile()
        assert ours.poll(JOIN_TIMEOUT_S), "the child did not answer in time"
        answer = ours.recv()
        process.join(JOIN_TIMEOUT_S)
        assert process.exitcode == 0, process.exitcode
        return answer
    finally:
        if process.is_alive():
            process.kill()
            process.join()


def _child_work(store: Store, values: dict, big: bytes, buffer: np.ndarray) -> dict:
    """What a child does with the parent's Store: reads what the parent put (a large object
    too, and pages into a buffer the parent registered), puts its own keys, then closes it."""
    assert store.get("big") == big
    keys = list(values)
    sizes = store.batch_get_into(keys, [buffer.ctypes.data + i * PAGE for i in range(KEYS)], [PAGE] * KEYS)
    into_buffer = sizes == [PAGE] * KEYS and buffer.tobytes() == b"".join(values.values())
    for _ in range(ROUNDS):  # while the parent's thread that forked gets too
        assert store.get_batch(keys) == list(values.values())
    codes = store.put_batch([f"child-{i}" for i in range(KEYS)], [b"c%d" % i * 100 for i in range(KEYS)])
    store.put("child-big", big[::-1])
    store.close()
    return {"into_buffer": into_buffer, "codes": codes}


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["same-host", "tcp"])
def test_a_store_is_used_in_a_forked_child_and_the_parent_keeps_its_connections(make_cluster, shm_enabled):
    cluster = make_cluster(2, "128MiB")
    store = Store(cluster.master_endpoint, shm_enabled=shm_enabled, rpc_timeout_ms=5_000, transfer_timeout_ms=5_000)
    try:
        values = {f"page-{i}": os.urandom(PAGE) for i in range(KEYS)}
        big = os.urandom(BIG)
        assert store.put_batch(list(values), list(values.values())) == [ErrorCode.OK] * KEYS
        store.put("big", big)
        buffer = np.zeros(PAGE * KEYS, dtype=np.uint8)
        store.register_buffer(buffer)
        # Another parent thread holds connections of its own (master and nodes) across the fork.
        asked, release = threading.Event(), threading.Event()

        def other_thread() -> None:
            assert store.get_batch(list(values)) == list(values.values())
            asked.set()
            release.wait(JOIN_TIMEOUT_S)

        thread = threading.Thread(target=other_thread)
        thread.start()
        assert asked.wait(JOIN_TIMEOUT_S)
        held = store._direct.connections() + store._nodes.connections()
        assert len(held) >= (2 if shm_enabled else 3)

        def parent_gets() -> None:
            for _ in range(ROUNDS):
                assert store.get_batch(list(values)) == list(values.values())

        answer = _in_child(_child_work, store, values, big, buffer, meanwhile=parent_gets)

        assert answer == {"result": {"into_buffer": True, "codes": [ErrorCode.OK] * KEYS}}
        assert all(conn.is_usable() for conn in held), held  # none shut down by the child
        release.set()
        thread.join()
        assert store.get_batch([f"child-{i}" for i in range(KEYS)]) == [b"c%d" % i * 100 for i in range(KEYS)]
        assert store.get("child-big") == big[::-1]
        assert store.get("big") == big
    finally:
        store.close()


def _child_get(store: Store, key: str) -> bytes | None:
    return store.get(key)


def test_a_store_that_contributes_a_segment_is_refused_in_a_forked_child(make_cluster):
    cluster = make_cluster(0)
    with Store(cluster.master_endpoint, embedded_memory_bytes=16 << 20) as store:
        store.put("k", b"v" * 1000)
        answer = _in_child(_child_get, store, "k")
        assert answer["error"].startswith(InvalidRequest.__name__), answer
        assert "contributes a segment" in answer["error"]
        assert store.get("k") == b"v" * 1000  # the parent's segment serves on
