#!/usr/bin/env python3
"""Conformance of kvpool's Mooncake-compatible API with the real Mooncake Store.

Runs one sequence of calls (every method of `mooncake.store.MooncakeDistributedStore` that
kvpool.integrations.mooncake_compat implements) against the real Mooncake Store (PyPI package
`mooncake-transfer-engine-non-cuda`: its `mooncake_master` and a TCP client with the
P2PHANDSHAKE metadata mode) and against kvpool (a LocalCluster master, the compat client
contributing its segment as Mooncake's client does), then compares every return value.

Mooncake's client and transfer engine listen on every interface (INADDR_ANY) and cannot be told
otherwise, so the script re-executes itself in a new network namespace that holds only a
loopback interface (`unshare --net`, needs root): nothing it starts is reachable from, or
talks to, anything but 127.0.0.1. Not a benchmark; not part of the kvpool package.

Usage: python scripts/mooncake_conformance.py [--json PATH]
Exit status: 0 all values agree, 1 a difference (printed), 2 the run itself failed,
77 Mooncake is not installed or no namespace can be made (skipped).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

EXIT_SKIP = 77
SEGMENT_SIZE_BYTES = 16 * 1024 * 1024
SIDE_TIMEOUT_S = 120
MASTER_READY_TIMEOUT_S = 20


# Calls where kvpool deliberately answers differently, with the reason. Each is still run and
# printed (as KNOWN), and fails the run if either side's value changes.
KNOWN_DIVERGENCES: dict[str, str] = {
    "get_batch of no keys": (
        "Mooncake returns [b''] for an empty key list (store_py.cpp get_batch returns one "
        "empty bytes when batch_get_buffer returns nothing); kvpool returns one value per "
        "key, i.e. []"
    ),
}


# --- the sequence ------------------------------------------------------------------------------


def run_sequence(store_cls: type, config_cls: type, master: str) -> list[tuple[str, Any]]:
    """Call every API once or more and return (label, normalized value) pairs in call order."""
    import numpy as np
    import torch

    out: list[tuple[str, Any]] = []

    def record(label: str, value: Any) -> Any:
        out.append((label, normalize(value)))
        return value

    store = store_cls()
    record("health_check before setup", store.health_check())
    record("setup positional", store.setup(
        "127.0.0.1", "P2PHANDSHAKE", SEGMENT_SIZE_BYTES, SEGMENT_SIZE_BYTES, "tcp", "", master
    ))  # fmt: skip
    record("health_check", store.health_check())
    hostname = store.get_hostname()
    record("get_hostname is host:port", _is_host_port(hostname))

    # Bytes API.
    record("put", store.put("k/a", b"hello"))
    record("put same again", store.put("k/a", b"hello"))
    record("put other bytes, same key", store.put("k/a", b"other"))
    record("get", store.get("k/a"))
    record("get absent", store.get("absent"))
    big = bytes(range(256)) * 400
    record("put_batch", store.put_batch(["k/b", "k/c"], [b"1", big]))
    record("get_batch", store.get_batch(["k/b", "absent", "k/c"]))
    record("put_parts", store.put_parts("k/parts", b"ab", b"cd", memoryview(b"ef")))
    record("get put_parts", store.get("k/parts"))
    record("put empty value", store.put("k/empty", b""))
    record("put bytearray", store.put("k/ba", bytearray(b"xyz")))
    record("put numpy", store.put("k/np", np.arange(10, dtype=np.uint8)))
    record("get numpy", store.get("k/np"))

    # Metadata.
    record("is_exist", store.is_exist("k/a"))
    record("is_exist absent", store.is_exist("absent"))
    record("batch_is_exist", store.batch_is_exist(["k/a", "absent", "k/c"]))
    record("get_size", store.get_size("k/c"))
    record("get_size absent", store.get_size("absent"))
    descriptors = store.get_replica_desc("k/c")
    record("get_replica_desc", [
        (d.is_memory_replica(), d.is_disk_replica(), d.is_local_disk_replica(), int(d.status))
        for d in descriptors
    ])  # fmt: skip
    memory = descriptors[0].get_memory_descriptor().buffer_descriptor
    record("get_replica_desc buffer", [memory.size, _is_host_port(memory.transport_endpoint)])
    try:
        record("get_disk_descriptor of a memory replica", descriptors[0].get_disk_descriptor())
    except RuntimeError as exc:
        record("get_disk_descriptor of a memory replica", str(exc))
    record("get_replica_desc absent", store.get_replica_desc("absent"))
    found = store.batch_get_replica_desc(["k/a", "absent", "k/c"])
    record("batch_get_replica_desc", sorted((key, len(found[key])) for key in found))
    record("batch_get_replica_desc of no keys", sorted(store.batch_get_replica_desc([])))

    # ReplicateConfig.
    config = config_cls()
    record("ReplicateConfig defaults", [config.replica_num, config.with_hard_pin,
                                        config.preferred_segment, list(config.preferred_segments),
                                        config.prefer_alloc_in_same_node])  # fmt: skip
    record("put with config", store.put("k/cfg", b"c" * 100, config))
    config.preferred_segment = hostname
    record("put preferring own segment", store.put("k/pref", b"p" * 100, config))
    config = config_cls()
    config.with_hard_pin = True
    record("put hard pinned", store.put("k/pin", b"h" * 100, config))
    record("get_batch configured", store.get_batch(["k/cfg", "k/pref", "k/pin"]))

    # Removal (a get leaves a read lease: remove without force is refused during it).
    record("remove under lease", store.remove("k/a"))
    record("remove force", store.remove("k/a", force=True))
    record("remove absent", store.remove("absent"))
    record("is_exist removed", store.is_exist("k/a"))
    record("batch_remove", store.batch_remove(["k/b", "absent"], force=True))
    record("put never read", store.put("k/unread", b"u"))
    record("remove never read", store.remove("k/unread"))

    # Zero-copy API.
    source = np.frombuffer(bytes(range(256)) * 4096, dtype=np.uint8).copy()  # 1 MiB
    target = np.zeros(1 << 20, dtype=np.uint8)
    src, dst = source.ctypes.data, target.ctypes.data
    record("register_buffer source", store.register_buffer(src, source.nbytes))
    record("register_buffer target", store.register_buffer(dst, target.nbytes))
    record("put_from", store.put_from("z/one", src + 10, 4096))
    record("get_into", store.get_into("z/one", dst, target.nbytes))
    record("get_into bytes", target[:4096].tobytes() == source[10:4106].tobytes())
    record("get_into absent", store.get_into("absent", dst, target.nbytes))
    record("batch_put_from", store.batch_put_from(["z/b0", "z/b1"], [src + 4096, src + 8192], [1000, 2000]))
    target[:] = 0
    record("batch_get_into", store.batch_get_into(
        ["z/b0", "z/b1", "absent"], [dst, dst + 4096, dst + 8192], [4096, 4096, 4096]
    ))  # fmt: skip
    record("batch_get_into bytes", [
        target[:1000].tobytes() == source[4096:5096].tobytes(),
        target[4096:6096].tobytes() == source[8192:10192].tobytes(),
    ])  # fmt: skip
    parts_src = [src + 20_000, src + 30_000, src + 40_000]
    record("batch_put_from_multi_buffers", store.batch_put_from_multi_buffers(
        ["z/m0", "z/m1"], [parts_src, [src + 50_000]], [[100, 200, 300], [64]]
    ))  # fmt: skip
    target[:] = 0
    parts_dst = [dst + 100_000, dst + 200_000, dst + 300_000]
    record("batch_get_into_multi_buffers", store.batch_get_into_multi_buffers(
        ["z/m0", "z/m1", "absent"], [parts_dst, [dst], [dst + 400_000]], [[100, 200, 300], [64], [64]]
    ))  # fmt: skip
    record("batch_get_into_multi_buffers bytes", [
        target[100_000:100_100].tobytes() == source[20_000:20_100].tobytes(),
        target[200_000:200_200].tobytes() == source[30_000:30_200].tobytes(),
        target[300_000:300_300].tobytes() == source[40_000:40_300].tobytes(),
        target[:64].tobytes() == source[50_000:50_064].tobytes(),
    ])  # fmt: skip
    record("get of a multi-buffer object", store.get("z/m0") == (
        source[20_000:20_100].tobytes() + source[30_000:30_200].tobytes() + source[40_000:40_300].tobytes()
    ))  # fmt: skip
    small = np.zeros(100, dtype=np.uint8)
    record("register_buffer small", store.register_buffer(small.ctypes.data, small.nbytes))
    record("get_into too small a buffer", store.get_into("z/one", small.ctypes.data, small.nbytes))
    record("batch_get_into too small a buffer", store.batch_get_into(
        ["z/one", "z/b0"], [small.ctypes.data, dst], [small.nbytes, 4096]
    ))  # fmt: skip
    record("unregister_buffer small", store.unregister_buffer(small.ctypes.data))
    record("unregister_buffer source", store.unregister_buffer(src))
    record("unregister_buffer target", store.unregister_buffer(dst))

    # Buffer handles.
    handle = store.get_buffer("z/one")
    record("get_buffer", [handle.size(), len(handle), bytes(memoryview(handle)) == source[10:4106].tobytes()])
    record("get_buffer ptr", handle.ptr() != 0)
    record("get_buffer numpy", np.array(handle, copy=False).nbytes)
    record("get_buffer absent", store.get_buffer("absent"))
    handles = store.batch_get_buffer(["z/b0", "absent"])
    record("batch_get_buffer", [h.size() if h is not None else None for h in handles])

    # Tensors.
    t_float = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t_bf16 = torch.linspace(-1, 1, 7, dtype=torch.bfloat16)
    t_int = torch.tensor([[1, -2], [3, 4]], dtype=torch.int64)
    record("put_tensor", store.put_tensor("t/x", t_float))
    got = store.get_tensor("t/x")
    record("get_tensor", [str(got.dtype), list(got.shape), bool(torch.equal(got, t_float))])
    record("get_tensor absent", store.get_tensor("absent"))
    record("batch_put_tensor", store.batch_put_tensor(["t/y", "t/z"], [t_bf16, t_int]))
    got = store.batch_get_tensor(["t/y", "absent", "t/z"])
    record("batch_get_tensor", [
        [str(got[0].dtype), bool(torch.equal(got[0], t_bf16))],
        got[1],
        [str(got[2].dtype), bool(torch.equal(got[2], t_int))],
    ])  # fmt: skip

    # Edge cases.
    record("get_batch of no keys", store.get_batch([]))
    record("batch_is_exist of no keys", store.batch_is_exist([]))
    record("batch_remove of no keys", store.batch_remove([]))
    record("put_batch of no keys", store.put_batch([], []))
    record("remove_by_regex under lease", store.remove_by_regex("^z/b"))
    record("put_batch with a repeated key", store.put_batch(["k/dup", "k/dup"], [b"one", b"two"]))
    record("get repeated key", store.get("k/dup"))

    # Bulk removal.
    record("remove_by_regex", store.remove_by_regex("^t/", force=True))
    record("batch_is_exist after regex", store.batch_is_exist(["t/x", "t/y", "z/one"]))
    record("remove_all", store.remove_all(force=True))
    record("is_exist after remove_all", store.batch_is_exist(["z/one", "k/c"]))

    record("close", store.close())
    record("health_check after close", store.health_check())
    record("close again", store.close())

    # The dict form of setup.
    second = store_cls()
    record("setup dict", second.setup({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "master_server_addr": master, "global_segment_size": SEGMENT_SIZE_BYTES,
        "protocol": "tcp",
    }))  # fmt: skip
    record("dict put", second.put("d/1", b"dict form"))
    record("dict get", second.get("d/1"))
    record("dict close", second.close())
    third = store_cls()
    record("setup dict missing metadata_server", third.setup({"local_hostname": "127.0.0.1"}))
    record("setup dict bad size", third.setup({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "lots",
    }))  # fmt: skip
    third.close()
    return out


def normalize(value: Any) -> Any:
    """A JSON-ready form that compares equal across the two stores."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if len(data) <= 64:
            return {"bytes": data.hex()}
        return {"bytes_len": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    return {"type": type(value).__name__}


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit()


# --- the two sides -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mooncake(log_dir: Path) -> list[tuple[str, Any]]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    master_bin = shutil.which("mooncake_master")
    if master_bin is None:
        import mooncake

        candidate = Path(mooncake.__file__).parent / "mooncake_master"
        master_bin = str(candidate) if candidate.exists() else None
    if master_bin is None:
        raise RuntimeError("mooncake_master not found")
    port = free_port()
    log_file = open(log_dir / "mooncake_master.log", "wb")
    master = subprocess.Popen(
        [
            master_bin, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
            "--enable_http_metadata_server=false", "--logtostderr",
        ],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + MASTER_READY_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if master.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not start (see {log_file.name})") from None
                time.sleep(0.05)
        return run_sequence(MooncakeDistributedStore, ReplicateConfig, f"127.0.0.1:{port}")
    finally:
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait(10)


def run_kvpool(log_dir: Path) -> list[tuple[str, Any]]:
    from kvpool.cli.launcher import LocalCluster
    from kvpool.integrations.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

    with LocalCluster(node_count=0, workdir=log_dir) as cluster:
        return run_sequence(MooncakeDistributedStore, ReplicateConfig, cluster.master_endpoint)


SIDES: dict[str, Callable[[Path], list[tuple[str, Any]]]] = {
    "mooncake": run_mooncake,
    "kvpool": run_kvpool,
}


# --- driver ------------------------------------------------------------------------------------


KNOWN_VALUES = {"get_batch of no keys": ([{"bytes": ""}], [])}
assert set(KNOWN_VALUES) == set(KNOWN_DIVERGENCES)


def compare(mooncake: list, kvpool: list) -> list[str]:
    """Every difference that is not a known divergence with exactly its known values."""
    problems = []
    for index, ((label_m, value_m), (label_k, value_k)) in enumerate(zip(mooncake, kvpool)):
        assert label_m == label_k, (index, label_m, label_k)
        if label_m in KNOWN_VALUES:
            if (value_m, value_k) != KNOWN_VALUES[label_m]:
                problems.append(f"{label_m}: known divergence changed: mooncake={value_m!r} "
                                f"kvpool={value_k!r}")  # fmt: skip
        elif value_m != value_k:
            problems.append(f"{label_m}: mooncake={value_m!r} kvpool={value_k!r}")
    if len(mooncake) != len(kvpool):
        problems.append(f"sequence lengths differ: mooncake={len(mooncake)} kvpool={len(kvpool)}")
    return problems


def run_side(side: str, log_dir: Path) -> list:
    """Run one side in its own process (Mooncake's client keeps threads for its life)."""
    command = [sys.executable, __file__, "--side", side, "--log-dir", str(log_dir)]
    result = subprocess.run(
        command, capture_output=True, timeout=SIDE_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    (log_dir / f"{side}.stderr").write_bytes(result.stderr)
    if result.returncode != 0:
        tail = result.stderr.decode(errors="replace")[-3000:]
        raise RuntimeError(f"{side} side failed (exit {result.returncode}):\n{tail}")
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


def in_private_netns() -> bool:
    """True when the only network interface here is loopback."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write both sides' values here")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep logs here")
    args = parser.parse_args()

    if args.side:
        values = SIDES[args.side](args.log_dir)
        print(json.dumps(values))
        return 0

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        print(f"SKIP: mooncake.store does not import ({exc}); install it with "
              "scripts/install-peers.sh mooncake")  # fmt: skip
        return EXIT_SKIP
    if not in_private_netns():
        unshare, ip = shutil.which("unshare"), shutil.which("ip")
        if os.geteuid() != 0 or unshare is None or ip is None:
            print("SKIP: Mooncake listens on every interface; this script runs it in a private "
                  "network namespace, which needs root, unshare and ip")  # fmt: skip
            return EXIT_SKIP
        inner = " ".join(
            ["ip link set lo up &&", "exec", sys.executable, __file__]
            + [f"'{a}'" for a in sys.argv[1:]]
        )
        return subprocess.run([unshare, "--net", "sh", "-c", inner], stdin=subprocess.DEVNULL).returncode

    import tempfile

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvpool-conformance-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        mooncake = run_side("mooncake", log_dir)
        kvpool = run_side("kvpool", log_dir)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"ERROR: {exc}\nlogs in {log_dir}")
        return 2
    if args.json:
        args.json.write_text(json.dumps({"mooncake": mooncake, "kvpool": kvpool}, indent=1))
    problems = compare(mooncake, kvpool)
    for label, value in mooncake:
        if any(p.startswith(label + ":") for p in problems):
            status = "DIFF "
        elif label in KNOWN_DIVERGENCES:
            status = "KNOWN"
        else:
            status = "same "
        print(f"{status} {label}: {json.dumps(value)[:100]}")
    for label, reason in KNOWN_DIVERGENCES.items():
        print(f"\nKNOWN {label}: {reason}")
    if problems:
        print(f"\n{len(problems)} of {len(mooncake)} return values differ:")
        for problem in problems:
            print("  " + problem)
        return 1
    print(f"\nall {len(mooncake)} return values agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
