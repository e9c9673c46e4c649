"""The client API used as a hurried integrator would, against a real local cluster: each misuse
is a typed error (kvpool.errors) that names the problem, and leaves what is stored as it was.
(Most misuses are covered where their feature is tested: test_client_api, test_client_buffers,
test_client_edges, test_store_lifecycle; these are the ones an earlier review found wanting.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import AsyncStore, ErrorCode, Store, limits
from kvpool.cli.launcher import LocalCluster
from kvpool.errors import InvalidKey, InvalidParams, StoreClosed

KEY_MAX = limits.KEY_SIZE_BYTES_MAX


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """One cluster for the module (a master and a node, ended by their ids at its end): no
    test here fills it or takes it down."""
    with LocalCluster(1, "32MiB") as cluster:
        yield cluster.master_endpoint


@contextlib.contextmanager
def either_store(api: str, endpoint: str) -> Iterator:
    """A Store, or an AsyncStore on a loop of its own whose coroutine calls run to their end."""
    if api == "Store":
        with Store(endpoint, token="") as store:
            yield store
        return
    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(AsyncStore.open(endpoint, token=""))

    class RunToTheEnd:
        def __getattr__(self, name: str):
            call = getattr(store, name)
            if not asyncio.iscoroutinefunction(call):
                return call
            return lambda *args: loop.run_until_complete(call(*args))

    try:
        yield RunToTheEnd()
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_a_put_of_a_key_or_size_the_master_refuses_says_what_a_key_or_object_holds(endpoint, api):
    """put("", v), a key of 4 KiB + 1 bytes, an empty or a 1 GiB + 1 value: the error said only
    "put '' failed: INVALID_KEY" (or INVALID_PARAMS), leaving the caller to guess which rule it
    broke. Objects stored before are untouched, and a batch keeps its other keys."""
    with either_store(api, endpoint) as store:
        store.put(f"kept-{api}", b"k" * 1000)
        with pytest.raises(InvalidKey, match=rf"a key holds 1 to {KEY_MAX} bytes of UTF-8 \(this one: 0\)"):
            store.put("", b"v")
        with pytest.raises(InvalidKey, match=rf"1 to {KEY_MAX} bytes of UTF-8 \(this one: {KEY_MAX + 1}\)"):
            store.put("é" * (KEY_MAX // 2) + "x", b"v")  # counted in bytes, not characters
        store.put("k" * KEY_MAX, b"v")  # the longest key is a key
        assert store.get("k" * KEY_MAX) == b"v"
        with pytest.raises(InvalidParams, match="an object holds 1 to .* bytes .*empty objects are not stored"):
            store.put("empty", b"")
        too_big = np.zeros(limits.OBJECT_SIZE_BYTES_MAX + 1, dtype=np.uint8)  # calloc: never touched
        with pytest.raises(InvalidParams, match=f"an object holds 1 to {limits.OBJECT_SIZE_BYTES_MAX} bytes"):
            store.put("too-big", too_big)
        codes = store.put_batch(["", "empty", f"fine-{api}"], [b"v", b"", b"f"])
        assert codes == [ErrorCode.INVALID_KEY, ErrorCode.INVALID_PARAMS, ErrorCode.OK]
        assert store.get_batch([f"kept-{api}", f"fine-{api}", "empty"]) == [b"k" * 1000, b"f", None]


def test_a_closed_async_store_refuses_to_register_or_unregister_a_buffer(endpoint):
    """A Store refuses register_buffer and unregister_buffer once closed (StoreClosed); an
    AsyncStore took the registration after aclose(), and kept the caller's buffer alive."""

    async def main() -> None:
        store = await AsyncStore.open(endpoint, token="")
        buffer = bytearray(4096)
        address = store.register_buffer(buffer)
        await store.aclose()
        with pytest.raises(StoreClosed):
            store.register_buffer(bytearray(4096))
        with pytest.raises(StoreClosed):
            store.unregister_buffer(address)
        with pytest.raises(StoreClosed):
            await store.get_into("k", address, len(buffer))
        with pytest.raises(StoreClosed):  # was taken, and the block ran on a closed store (helper-157)
            async with store:
                pass

    asyncio.run(asyncio.wait_for(main(), 30))
    closed = Store(endpoint, token="")
    closed.close()
    with pytest.raises(StoreClosed):
        with closed:
            pass


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rpc_timeout_ms": "5000"}, r"Expected `int`, got `str` - at `\$.rpc_timeout_ms`"),  # read from os.environ
        ({"transfer_timeout_ms": 1.5e4}, r"Expected `int`, got `float` - at `\$.transfer_timeout_ms`"),
        ({"shm_enabled": "false"}, r"Expected `bool`, got `str` - at `\$.shm_enabled`"),  # was taken as True
        ({"token": 1234}, r"Expected `str \| null`, got `int` - at `\$.token`"),
        ({"master": 50051}, r"Expected `str`, got `int` - at `\$.master`"),
        ({"timeout_ms": 5000}, "no option 'timeout_ms': a Store takes master, token, "),
    ],
    ids=["str-timeout", "float-timeout", "str-flag", "int-token", "int-master", "unknown"],
)
def test_an_option_of_another_type_or_name_is_invalid_params_naming_it(endpoint, api, options, match):
    """Store(master, **options) and AsyncStore.open(...) with an option the way a config file
    or the environment hands it over: a TypeError from inside ClientConfig ("'<=' not
    supported between instances of 'str' and 'int'"), an AttributeError, or nothing at all
    (shm_enabled="false" turned the same-host paths on). Numpy integers are integers."""
    options = {"master": endpoint, "token": "", **options}

    async def open_async() -> None:
        store = await AsyncStore.open(**options)
        await store.aclose()  # reached only where the option was (wrongly) taken

    with pytest.raises(InvalidParams, match=match):
        if api == "Store":
            Store(**options).close()
        else:
            asyncio.run(open_async())
    with Store(endpoint, token="", rpc_timeout_ms=np.int64(5000), dfs_dir=Path("")) as store:
        assert store.get("nothing") is None  # numpy integers are integers, a Path is a path


@pytest.mark.parametrize("shm_enabled", [True, False])
def test_a_batch_at_the_limits_of_keys_and_key_size_goes_through(endpoint, shm_enabled):
    """16,384 keys (BATCH_KEYS_MAX) of 4,096 bytes (KEY_SIZE_BYTES_MAX) each: a batch inside
    both documented limits failed with LocalProtocolError, its control message (the keys
    alone 64 MiB) over the 64 MiB a frame could carry; and a same-host get of 16,384 keys
    (of 64 bytes too) timed out: its pieces' lookups, sent together, waited on their own
    replies, which the master stops sending to a peer that does not read them."""
    keys = [f"{i:08d}".ljust(KEY_MAX, "k") for i in range(limits.BATCH_KEYS_MAX)]
    with Store(endpoint, token="", shm_enabled=shm_enabled) as store:
        assert store.put_batch(keys, [b"x"] * len(keys)) == [0] * len(keys)
        assert store.batch_exists(keys) == [True] * len(keys)
        assert store.longest_prefix(keys) == len(keys)
        assert store.get_batch(keys) == [b"x"] * len(keys)
        assert store.batch_remove(keys) == [0] * len(keys)
