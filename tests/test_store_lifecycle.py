"""A Store's life as a serving process sees it: closed, it refuses every call and opens nothing
again; opened before the process forks (multiprocessing's default start method on Linux, as
serving engines' worker pools use it), it works in the child, and the parent's Store keeps
every connection it had: the child opens its own and never touches the parent's."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import selectors
import signal
import threading
import time

import numpy as np
import pytest

from kvpool import AsyncStore, ErrorCode, ReplicateConfig, Store
from kvpool.client import node_links
from kvpool.errors import InvalidRequest, KVPoolError, StoreClosed

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


def _holds_no_connection(store: Store) -> bool:
    """Whether a closed Store holds no open connection: its threads', its loop's to the master
    and to nodes."""
    master = store._opened._master._conn
    return (
        store._direct.connections() == [] and store._nodes.connections() == []
        and (master is None or master.is_closed()) and not store._opened._peers._conns
    )  # fmt: skip


def _closed_calls(store: Store, address: int) -> list:
    """Every kind of call on a closed Store: each must raise StoreClosed."""
    return [
        lambda: store.get("k"),
        lambda: store.put("k2", b"v"),
        lambda: store.get_batch(["k", "k2"]),
        lambda: store.batch_get_into(["k"], [address], [PAGE]),
        lambda: store.batch_put_from(["k3"], [address], [PAGE]),
        lambda: store.exists("k"),
        lambda: store.get_size("k"),
        lambda: store.remove("k"),
        lambda: store.remove_all(),
        lambda: store.list_objects(),
        lambda: store.register_buffer(bytearray(PAGE)),
    ]


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["same-host", "tcp"])
def test_a_closed_store_refuses_every_call_and_opens_no_connection_again(make_cluster, shm_enabled):
    cluster = make_cluster(1, "64MiB")
    store = Store(cluster.master_endpoint, shm_enabled=shm_enabled)
    buffer = np.zeros(PAGE, dtype=np.uint8)
    address = store.register_buffer(buffer)
    store.put("k", b"v" * PAGE)
    other = threading.Thread(target=lambda: store.get("k"))  # a thread's own connections too
    other.start()
    other.join()
    store.close()
    for call in _closed_calls(store, address):
        with pytest.raises(StoreClosed):
            call()
    failures: list[BaseException] = []
    other = threading.Thread(target=lambda: failures.append(pytest.raises(StoreClosed, store.get, "k").value))
    other.start()
    other.join()
    assert len(failures) == 1
    store.close()  # again: nothing to do
    assert _holds_no_connection(store)
    with Store(cluster.master_endpoint) as another:  # no lease of a closed Store holds "k"
        another.remove("k")
        assert another.get("k") is None


def test_a_closed_async_store_refuses_every_call_and_opens_no_connection_again(make_cluster):
    cluster = make_cluster(1, "64MiB")

    async def main() -> None:
        store = await AsyncStore.open(cluster.master_endpoint)
        await store.put("k", b"v" * 100)
        assert await store.get("k") == b"v" * 100
        await store.aclose()
        for call in (store.get("k"), store.put("k2", b"v"), store.exists("k"), store.remove("k")):
            with pytest.raises(StoreClosed):
                await call
        await store.aclose()
        assert (store._master._conn is None or store._master._conn.is_closed()) and not store._peers._conns

    asyncio.run(asyncio.wait_for(main(), JOIN_TIMEOUT_S))


CALLER = "kvpool-test-caller"  # the thread errors_of_a_call_a_close_overtakes runs the call on


def errors_of_a_call_a_close_overtakes(
    store: Store, call, reached: threading.Event, closed: threading.Event
) -> list[BaseException]:
    """Run `call` on a thread named CALLER; once it has `reached` the point where the test's
    patch holds it, close `store` from this thread and let the call go on (`closed`). Returns
    what the call raised."""
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            errors.append(exc)

    thread = threading.Thread(target=caller, name=CALLER)
    thread.start()
    assert reached.wait(JOIN_TIMEOUT_S)
    store.close()
    closed.set()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive()
    return errors


@pytest.mark.parametrize("call", ["put", "get", "get_into"])
def test_a_same_host_copy_that_a_close_from_another_thread_overtakes_raises_store_closed(
    make_cluster, monkeypatch, call
):
    """A serving engine shuts down while its threads still load and store blocks: a caller
    thread whose put or get had its grants or replicas, and then found the segments unmapped
    by a close, raised ValueError ("operation forbidden on released memoryview object")
    instead of StoreClosed."""
    cluster = make_cluster(1, "32MiB")
    store = Store(cluster.master_endpoint, shm_enabled=True)
    buffer = np.zeros(PAGE, dtype=np.uint8)
    address = store.register_buffer(buffer)
    store.put("k", b"v" * PAGE)
    local_segment = AsyncStore._local_segment
    mapped, closed = threading.Event(), threading.Event()

    def mapped_then_closed(async_store, info):  # the caller thread has the segment, then the close comes
        segment = local_segment(async_store, info)
        if threading.current_thread().name == CALLER and not mapped.is_set():
            mapped.set()
            assert closed.wait(JOIN_TIMEOUT_S)
        return segment

    monkeypatch.setattr(AsyncStore, "_local_segment", mapped_then_closed)
    calls = {
        "put": lambda: store.put("k2", b"w" * PAGE),
        "get": lambda: store.get("k"),
        "get_into": lambda: store.get_into("k", address, PAGE),
    }
    errors = errors_of_a_call_a_close_overtakes(store, calls[call], mapped, closed)
    assert len(errors) == 1 and isinstance(errors[0], StoreClosed), errors
    assert not any("/dev/shm" in line for line in open("/proc/self/maps"))  # noqa: SIM115


@pytest.mark.parametrize("call", ["get", "put"])
def test_a_transfer_with_several_nodes_that_a_close_from_another_thread_overtakes_raises_store_closed(
    make_cluster, monkeypatch, call
):
    """A caller thread's round with two nodes over its own connections (node_links.py), the
    frames begun, when a close from another thread closed those connections: the round
    registered their stale descriptors with its selector and raised OSError (EBADF) out of
    get_batch and put_batch, instead of StoreClosed."""
    cluster = make_cluster(2, "32MiB")
    store = Store(cluster.master_endpoint, shm_enabled=False)
    segments = list(store.cluster_status().segment_infos())
    assert len(segments) == 2
    keys = [f"k{i}" for i in range(2)]  # one on each node
    for key, segment in zip(keys, segments):
        store.put(key, b"v" * PAGE, ReplicateConfig(placement="preferred", preferred_segments=[segment]))
    assert store.get_batch(keys) == [b"v" * PAGE] * 2  # this thread's connections to both nodes
    real_selector = node_links.selectors.DefaultSelector
    begun, closed = threading.Event(), threading.Event()

    def begun_then_closed() -> selectors.BaseSelector:  # both frames begun, then the close comes
        if threading.current_thread().name == CALLER and not begun.is_set():
            begun.set()
            assert closed.wait(JOIN_TIMEOUT_S)
        return real_selector()

    monkeypatch.setattr(node_links.selectors, "DefaultSelector", begun_then_closed)
    calls = {
        "get": lambda: store.get_batch(keys),
        "put": lambda: store.put("k2", b"w" * PAGE, ReplicateConfig(replica_num=2)),
    }
    errors = errors_of_a_call_a_close_overtakes(store, calls[call], begun, closed)
    assert len(errors) == 1 and isinstance(errors[0], StoreClosed), errors


def test_a_get_waiting_on_several_nodes_that_do_not_answer_ends_at_once_when_the_store_closes(make_cluster):
    """A caller thread's read of two nodes that stopped answering waits for their replies on
    a selector (node_links.py); a close from another thread closes its connections, which
    takes them out of the selector without waking it: the get returned StoreClosed only at
    the round's deadline (the lease, 10 s), where a read of one node returns at once."""
    cluster = make_cluster(2, "32MiB")
    store = Store(cluster.master_endpoint, shm_enabled=False)
    segments = list(store.cluster_status().segment_infos())
    keys = [f"k{i}" for i in range(2)]  # one on each node
    for key, segment in zip(keys, segments):
        store.put(key, b"v" * PAGE, ReplicateConfig(placement="preferred", preferred_segments=[segment]))
    outcome: dict[str, object] = {}
    waiting = threading.Event()

    def caller() -> None:
        assert store.get_batch(keys) == [b"v" * PAGE] * 2  # this thread's connections to both nodes
        for node in cluster.nodes:
            node.signal(signal.SIGSTOP)
        waiting.set()
        try:
            outcome["result"] = store.get_batch(keys)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome["result"] = exc
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert waiting.wait(JOIN_TIMEOUT_S)
        time.sleep(1)  # the frames sent, the replies waited for
        closed_at = time.monotonic()
        store.close()
        thread.join(JOIN_TIMEOUT_S)
    finally:
        for node in cluster.nodes:
            node.signal(signal.SIGCONT)
    assert isinstance(outcome["result"], StoreClosed), outcome
    assert outcome["ended"] - closed_at < 2, outcome["ended"] - closed_at


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_a_put_waiting_on_the_master_when_the_store_closes_raises_store_closed(make_cluster, api):
    """A put whose put_start the master has not answered (stopped with SIGSTOP) when the
    store closes under it. A put_start is not sent again once its connection breaks (the
    master may have granted it), and an AsyncStore's put raised RpcFailed, "connection
    closed: client closed": the same close that a call begun after it names StoreClosed."""
    cluster = make_cluster(1, "32MiB")
    outcome: dict[str, object] = {}
    if api == "Store":
        store = Store(cluster.master_endpoint, shm_enabled=False)
        store.put("k0", b"v" * PAGE)  # connected
        cluster.master.signal(signal.SIGSTOP)
        try:
            caller = threading.Thread(target=lambda: outcome.update(result=_raised(store.put, "k", b"v" * PAGE)))
            caller.start()
            time.sleep(0.5)  # the put_start sent, its answer waited for
            closed_at = time.monotonic()
            store.close()
            caller.join(JOIN_TIMEOUT_S)
            ended = time.monotonic()
        finally:
            cluster.master.signal(signal.SIGCONT)
    else:

        async def main() -> float:
            store = await AsyncStore.open(cluster.master_endpoint, shm_enabled=False)
            await store.put("k0", b"v" * PAGE)
            cluster.master.signal(signal.SIGSTOP)
            try:
                put = asyncio.ensure_future(store.put("k", b"v" * PAGE))
                await asyncio.sleep(0.5)
                closed_at = time.monotonic()
                await store.aclose()
                outcome["result"] = await _raised_async(put)
                return closed_at
            finally:
                cluster.master.signal(signal.SIGCONT)

        closed_at = asyncio.run(main())
        ended = time.monotonic()
    assert isinstance(outcome["result"], StoreClosed), outcome
    assert ended - closed_at < 2, ended - closed_at


def _raised(call, *args) -> object:
    try:
        return call(*args)
    except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
        return exc


async def _raised_async(awaitable) -> object:
    try:
        return await awaitable
    except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
        return exc


def _child_close_then_get(store: Store) -> str:
    store.close()  # the parent's Store, never used here: nothing of the parent's closes
    try:
        store.get("k")
    except StoreClosed:
        return "StoreClosed"
    return "answered"


def test_a_store_closed_in_the_parent_or_in_the_child_stays_closed_there(make_cluster):
    cluster = make_cluster(1, "64MiB")
    closed = Store(cluster.master_endpoint)
    closed.close()
    assert _in_child(_child_get, closed, "k")["error"].startswith(StoreClosed.__name__)
    with Store(cluster.master_endpoint) as store:
        store.put("k", b"v" * 100)
        assert _in_child(_child_close_then_get, store) == {"result": "StoreClosed"}
        assert store.get("k") == b"v" * 100  # the parent's copy is open


def _child_lists_first(store: Store) -> list[str]:
    """A child whose first call goes through the loop (list_objects): it must run on the
    child's own connection, not write to the parent's."""
    return store.list_objects().keys


def test_a_forked_childs_first_call_through_the_loop_uses_connections_of_its_own(make_cluster):
    cluster = make_cluster(1, "64MiB")
    with Store(cluster.master_endpoint) as store:
        store.put("k", b"v" * 100)
        master_connection = store._opened._master._conn
        assert _in_child(_child_lists_first, store) == {"result": ["k"]}
        assert store._opened._master._conn is master_connection and not master_connection.is_closed()
        assert store.list_objects().keys == ["k"]  # and no reply of the child's read as the parent's


def _child_closes_while_another_thread_reopens(store: Store) -> dict:
    opened = AsyncStore.open

    async def slow_open(*args, **options):  # in the child only: the reopen takes 0.5 s
        await asyncio.sleep(0.5)
        return await opened(*args, **options)

    AsyncStore.open = slow_open  # type: ignore[method-assign]
    first: list = []

    def get() -> None:  # reopens, then gets; the close may land during the get: then it fails
        try:
            first.append(store.get("k"))
        except KVPoolError as exc:
            first.append(type(exc).__name__)

    reopening = threading.Thread(target=get)
    reopening.start()
    time.sleep(0.1)
    store.close()
    reopening.join()
    try:
        store.get("k")
        after = "answered"
    except StoreClosed:
        after = "StoreClosed"
    return {"first": first[0], "after": after, "fresh_closed": store._opened._is_closed}


def test_a_store_closed_while_a_child_reopens_it_stays_closed(make_cluster):
    cluster = make_cluster(1, "64MiB")
    with Store(cluster.master_endpoint) as store:
        store.put("k", b"v" * 100)
        answer = _in_child(_child_closes_while_another_thread_reopens, store)["result"]
        assert answer["first"] in (b"v" * 100, "StoreClosed", "RpcFailed", "ConnectFailed"), answer
        assert answer["after"] == "StoreClosed" and answer["fresh_closed"], answer


@contextlib.contextmanager
def loop_on_a_thread():
    """An event loop running on a thread of its own: yields on_loop(coroutine) -> its result."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        yield lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result(JOIN_TIMEOUT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(JOIN_TIMEOUT_S)
        loop.close()


def _child_uses_an_async_store(store: AsyncStore) -> list[str]:
    outcomes = []
    for call in (lambda: store.get("k"), store.aclose):
        try:
            asyncio.run(call())
            outcomes.append("done")
        except InvalidRequest as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def test_an_async_store_refuses_a_forked_child_and_leaves_the_parents_connections(make_cluster):
    cluster = make_cluster(1, "64MiB")
    with loop_on_a_thread() as on_loop:
        store = on_loop(AsyncStore.open(cluster.master_endpoint))
        on_loop(store.put("k", b"v" * 100))
        connection = store._master._conn
        assert _in_child(_child_uses_an_async_store, store) == {"result": ["InvalidRequest", "done"]}
        assert on_loop(store.get("k")) == b"v" * 100
        assert store._master._conn is connection and not connection.is_closed()
        on_loop(store.aclose())


def test_an_async_store_refuses_another_event_loop_before_it_sends_anything(make_cluster):
    """An AsyncStore's connections belong to the loop it was opened on: a call from another
    loop (another thread's, or a later asyncio.run) is an InvalidRequest at once, before any
    request is written on a transport of the first loop, which keeps serving."""
    cluster = make_cluster(1, "64MiB")
    with loop_on_a_thread() as on_loop:
        store = on_loop(AsyncStore.open(cluster.master_endpoint))
        on_loop(store.put("k", b"v" * 100))
        for call in (lambda: store.get("k"), lambda: store.put("k2", b"v"), lambda: store.exists("k")):
            with pytest.raises(InvalidRequest, match="event loop"):
                asyncio.run(call())
        assert on_loop(store.get("k")) == b"v" * 100
        assert on_loop(store.exists("k2")) is False
        on_loop(store.aclose())


def _stored_and_nothing_held(endpoint: str, keys: list[str], values: list[bytes]) -> None:
    """A fresh Store reads every key back, and the master holds nothing beyond their objects:
    no put pending, no range quarantined."""
    from kvpool.master.allocator import footprint_bytes

    with Store(endpoint) as reader:
        assert reader.get_batch(keys) == values
        status = reader.cluster_status()
        assert status.pending_count == 0
        assert sum(s.used_bytes for s in status.segments) == sum(footprint_bytes(len(v)) for v in values)


@pytest.mark.parametrize("shm_enabled, beside_another", [(True, False), (False, False), (True, True)])
def test_a_put_under_way_when_another_thread_closes_the_store_finishes_stored(
    make_cluster, monkeypatch, shm_enabled, beside_another
):
    """A serving engine shuts down while a worker thread saves blocks. The close cut the put
    off and dropped what it gave back: its keys refused puts (REPLICA_IS_NOT_READY) for the
    master's discard timeout (30 s) and its ranges (16 MiB here) stayed out of use for the
    release timeout (10 minutes). A put under way now finishes first; no new put starts.
    `beside_another`: another thread's put under way too, so this one goes through the loop,
    its copy outlasting the close's first wait (the put then failed, and its keys stayed pending)."""
    from kvpool.client.transfer import PutJob

    cluster = make_cluster(1, "64MiB")
    store = Store(cluster.master_endpoint, shm_enabled=shm_enabled)
    store.put("warm-up", b"w")
    keys, values = [f"k{i}" for i in range(64)], [os.urandom(256 << 10) for _ in range(64)]
    copy_local, copying = PutJob.copy_local, threading.Event()
    held_s = 0.4 if beside_another else 0.0  # past CLOSE_PUTS_WAIT_MS (0.25 s)

    def copy_once_closing(job):  # the put holds here until the close has begun
        copying.set()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not store._closing and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(held_s)
        copy_local(job)

    if beside_another:
        store._puts_in_flight += 1  # as when another thread's put is under way

    monkeypatch.setattr(PutJob, "copy_local", copy_once_closing)
    outcome: dict[str, object] = {}
    caller = threading.Thread(target=lambda: outcome.update(codes=_raised(store.put_batch, keys, values)))
    caller.start()
    assert copying.wait(JOIN_TIMEOUT_S)
    store.close()
    caller.join(JOIN_TIMEOUT_S)
    monkeypatch.setattr(PutJob, "copy_local", copy_local)
    assert outcome["codes"] == [0] * len(keys), outcome
    with pytest.raises(StoreClosed):
        store.put("after", b"v")
    _stored_and_nothing_held(cluster.master_endpoint, ["warm-up", *keys], [b"w", *values])


def test_a_put_under_way_when_its_async_store_closes_finishes_stored(make_cluster, monkeypatch):
    """The same for an AsyncStore: a put writing to a node when aclose() came."""
    cluster = make_cluster(1, "64MiB")
    keys, values = [f"k{i}" for i in range(64)], [os.urandom(256 << 10) for _ in range(64)]
    run_batches = AsyncStore._run_batches

    async def writes_once_closing(self, batches, timeout_ms):
        while not self._is_closed:
            await asyncio.sleep(0.001)
        return await run_batches(self, batches, timeout_ms)

    async def main() -> object:
        store = await AsyncStore.open(cluster.master_endpoint, shm_enabled=False)
        put = asyncio.ensure_future(store.put_batch(keys, values))
        await asyncio.sleep(0.05)  # granted, held before its writes
        await store.aclose()
        with pytest.raises(StoreClosed):
            await store.put("after", b"v")
        return await _raised_async(put)

    monkeypatch.setattr(AsyncStore, "_run_batches", writes_once_closing)
    codes = asyncio.run(asyncio.wait_for(main(), JOIN_TIMEOUT_S))
    monkeypatch.setattr(AsyncStore, "_run_batches", run_batches)
    assert codes == [0] * len(keys), codes
    _stored_and_nothing_held(cluster.master_endpoint, keys, values)


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_a_put_a_close_cuts_off_gives_its_keys_back_at_once(make_cluster, api):
    """A put still writing to a node that stopped answering when the store closes ends with
    StoreClosed, and gives its keys back then: the close had dropped the revoke, and the
    keys refused puts until the master's discard timeout (30 s)."""
    cluster = make_cluster(2, "32MiB")
    first, second = cluster.nodes
    keys, values = [f"k{i}" for i in range(4)], [os.urandom(PAGE) for _ in range(4)]
    on_first, on_second = (ReplicateConfig(placement="preferred", preferred_segments=[n.info["segment_id"]])
                           for n in (first, second))  # fmt: skip
    outcome: dict[str, object] = {}
    first.signal(signal.SIGSTOP)
    try:
        if api == "Store":
            store = Store(cluster.master_endpoint, shm_enabled=False)
            put = lambda: outcome.update(result=_raised(store.put_batch, keys, values, on_first))  # noqa: E731
            caller = threading.Thread(target=put)
            caller.start()
            time.sleep(0.5)  # granted, the writes sent, their answers waited for
            store.close()
            caller.join(JOIN_TIMEOUT_S)
        else:

            async def main() -> None:
                store = await AsyncStore.open(cluster.master_endpoint, shm_enabled=False)
                put = asyncio.ensure_future(store.put_batch(keys, values, on_first))
                await asyncio.sleep(0.5)
                await store.aclose()
                outcome["result"] = await _raised_async(put)

            asyncio.run(asyncio.wait_for(main(), JOIN_TIMEOUT_S))
        assert isinstance(outcome["result"], StoreClosed), outcome
        with Store(cluster.master_endpoint) as other:
            codes = other.put_batch(keys, values, on_second)  # at once: not REPLICA_IS_NOT_READY
            assert codes == [0] * len(keys), codes
            assert other.get_batch(keys) == values
    finally:
        first.signal(signal.SIGCONT)


def test_an_async_store_closed_after_its_loop_ended_unmaps_its_segments(make_cluster):
    """An AsyncStore used in one asyncio.run and closed in a later one: aclose raised
    RuntimeError ("Event loop is closed") half-way, its segments left mapped. It closes what
    needs no loop now; from another loop still running, aclose is refused, named."""
    cluster = make_cluster(1, "32MiB")
    holder: dict[str, AsyncStore] = {}

    async def used() -> None:
        store = holder["store"] = await AsyncStore.open(cluster.master_endpoint)
        await store.put("k", b"v" * PAGE)
        assert await store.get("k") == b"v" * PAGE  # the node's segment mapped here

    async def closed_later() -> None:
        await holder["store"].aclose()
        with pytest.raises(StoreClosed):
            await holder["store"].get("k")

    asyncio.run(used())
    assert any("/dev/shm" in line for line in open("/proc/self/maps"))  # noqa: SIM115
    asyncio.run(closed_later())
    assert not any("/dev/shm" in line for line in open("/proc/self/maps"))  # noqa: SIM115

    async def opened() -> AsyncStore:
        return await AsyncStore.open(cluster.master_endpoint)

    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(opened())
        with pytest.raises(InvalidRequest, match="close it there"):
            asyncio.run(store.aclose())  # another loop, while its own still runs
        loop.run_until_complete(store.aclose())
    finally:
        loop.close()
