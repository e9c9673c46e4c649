"""Rotating the cluster token without a restart: a token file of several lines, and SIGUSR1.

A master or node accepts every token its file holds and connects (and signs grants) with the
first; SIGUSR1 reads the file again. So a token is rotated in three steps, none of which
restarts a process or loses an object (docs/operations.md "Rotating the token"). The tests run
real master and node processes, and check each server's handshake with each token directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import wait_until

from kvpool import ErrorCode, ReplicateConfig, Store, limits
from kvpool.config import ClientConfig, token_from, tokens_from
from kvpool.discovery import LeaderRecord, mark_key
from kvpool.errors import CoordinationError, InvalidParams, Unauthorized
from kvpool.master.election import ElectionConfig, Elector
from kvpool.protocol import auth
from kvpool.protocol.messages import WriteGrant
from kvpool.transports import files
from kvpool.transports.connection import connect
from kvpool.transports.dfs import DfsDirectory
from kvpool.transports.etcd import EtcdClient
from tests.test_ha import TTL_MS, new_cluster_id

OLD = "the-old-cluster-token-0123456789abcdef"
NEW = "the-new-cluster-token-fedcba9876543210"


# --- pure ---------------------------------------------------------------------------------------


def test_a_token_file_holds_one_token_per_line_the_first_the_one_to_connect_with(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text(f"# rotating: the new one first\n  {NEW}  \n\n{OLD}\n{NEW}\n")
    path.chmod(0o600)
    assert tokens_from(None, str(path)) == [NEW, OLD]  # stripped; comments, blank lines and repeats skipped
    assert token_from(None, str(path)) == NEW  # what a client connects with
    path.write_text(OLD)  # one line, as before
    assert tokens_from(None, str(path)) == [OLD]
    assert tokens_from(NEW, str(path)) == [NEW]  # an explicit token wins, as before
    assert tokens_from() == []
    path.write_text("# nothing but a comment\n")
    with pytest.raises(InvalidParams, match="is empty"):
        tokens_from(None, str(path))


def test_a_store_given_no_token_keeps_every_line_of_the_deployments_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "token"
    path.write_text(f"{NEW}\n{OLD}\n")
    path.chmod(0o600)
    monkeypatch.setenv("KVPOOL_TOKEN_FILE", str(path))
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    config = ClientConfig()
    assert (config.token, config.other_tokens) == (NEW, (OLD,))
    assert (ClientConfig(token=OLD).token, ClientConfig(token=OLD).other_tokens) == (OLD, ())  # in code: as given
    assert ClientConfig(token="").token == ""  # none, whatever the environment says


def test_a_token_short_enough_to_guess_is_taken_with_a_warning(tmp_path, caplog) -> None:
    path = tmp_path / "short"
    path.write_text("abc\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kvpool.config"):
        assert tokens_from(None, str(path)) == ["abc"]
        assert tokens_from(None, str(path)) == ["abc"]
    said = [r.getMessage() for r in caplog.records if "characters" in r.getMessage()]
    assert len(said) == 1 and "holds a token of 3 characters: whoever guesses it" in said[0]  # once per file


def test_a_keyring_accepts_each_of_its_keys_and_signs_with_the_first() -> None:
    old, new = auth.cluster_key(OLD), auth.cluster_key(NEW)
    keyring = auth.Keyring.of([NEW, OLD])
    assert keyring.primary == new and keyring.marks() == [auth.cluster_mark(new), auth.cluster_mark(old)]
    nonce_s, nonce_c = b"s" * 16, b"c" * 16
    for key in (old, new):
        assert keyring.proven_key(nonce_s, nonce_c, auth.client_proof(key, nonce_s, nonce_c)) == key
        assert keyring.is_valid_grant(auth.sign_grant(key, "seg", 0, 10, expiry_ms=100), now_ms=50)
    other = auth.cluster_key("a-third-token-0123456789abcdef")
    assert keyring.proven_key(nonce_s, nonce_c, auth.client_proof(other, nonce_s, nonce_c)) is None
    assert not keyring.is_valid_grant(auth.sign_grant(other, "seg", 0, 10, expiry_ms=100), now_ms=50)
    assert not keyring.is_valid_grant(auth.sign_grant(new, "seg", 0, 10, expiry_ms=100), now_ms=101)  # expired
    assert not keyring.is_valid_grant(WriteGrant("seg", 0, 10, 100, b"", 0), now_ms=50)  # unsigned
    keyring.replace([OLD])
    assert keyring.keys == (old,)
    # Whether a process has a token decides where it may listen: only a restart changes that.
    with pytest.raises(InvalidParams, match="keeps one"):
        keyring.replace([])
    with pytest.raises(InvalidParams, match="only at a restart"):
        auth.Keyring().replace([NEW])


def test_a_client_connects_with_its_next_token_once_a_server_refuses_its_first_as_wrong() -> None:
    old, new = auth.cluster_key(OLD), auth.cluster_key(NEW)
    keys = auth.Keyring([old, new])
    assert keys.primary == old
    assert keys.refused(old, Unauthorized("127.0.0.1:1 refused the connection: wrong cluster token"))
    assert keys.primary == new  # and the refused one last: tried again only after the others
    assert keys.refused(old, Unauthorized("... wrong cluster token"))  # another connection's news: try current
    assert keys.primary == new
    assert not keys.refused(new, Unauthorized("127.0.0.1:1 requires a cluster token"))  # not a wrong token
    assert not auth.Keyring([old]).refused(old, Unauthorized("wrong cluster token"))  # none other to try
    assert auth.Keyring().primary is None


def test_a_dfs_directory_marked_with_another_of_the_clusters_tokens_is_marked_with_the_first(tmp_path) -> None:
    old, new = (auth.cluster_mark(auth.cluster_key(token)) for token in (OLD, NEW))
    third = auth.cluster_mark(auth.cluster_key("a-third-token-0123456789abcdef"))
    DfsDirectory.create_or_open(tmp_path, 64 << 20, old)
    with pytest.raises(InvalidParams, match="another cluster"):
        DfsDirectory.create_or_open(tmp_path, 64 << 20, new)
    with pytest.raises(InvalidParams, match="another cluster"):
        DfsDirectory.create_or_open(tmp_path, 64 << 20, new, [third])
    identity = DfsDirectory.create_or_open(tmp_path, 64 << 20, new, [old]).identity()
    assert identity is not None and identity.owner == new
    assert files.load_identity(tmp_path).owner == new  # type: ignore[union-attr]
    DfsDirectory.create_or_open(tmp_path, 64 << 20, new)  # the new token alone: its own


def test_a_dfs_directory_is_marked_again_but_never_created_under_a_running_master(tmp_path) -> None:
    """A share unmounted under a running master leaves an empty mount point: a new identity
    there would be another tier's (its objects unknown to the nodes), so none is made."""
    old, new = (auth.cluster_mark(auth.cluster_key(token)) for token in (OLD, NEW))
    dfs = DfsDirectory(tmp_path / "unmounted")
    with pytest.raises(InvalidParams, match="holds no DFS identity"):
        dfs.mark_owner(new, [old])
    assert not (tmp_path / "unmounted").exists()
    DfsDirectory.create_or_open(tmp_path / "share", 64 << 20, old)
    DfsDirectory(tmp_path / "share").mark_owner(new, [old])
    assert files.load_identity(tmp_path / "share").owner == new  # type: ignore[union-attr]


class _FlakyEtcd:
    """etcd's create and put as the Elector calls them, the cluster's mark held here; each
    create fails while `failures` lasts (etcd unreachable)."""

    def __init__(self, held: str, failures: int) -> None:
        self.held, self.failures = held, failures

    async def create(self, key: bytes, value: bytes, *, lease_id: int) -> tuple[bool, object, int]:
        if self.failures:
            self.failures -= 1
            raise CoordinationError("etcd unreachable")
        return False, types.SimpleNamespace(value=self.held.encode()), 1

    async def put(self, key: bytes, value: bytes, *, lease_id: int = 0) -> int:
        self.held = value.decode()
        return 2


def test_the_etcd_mark_follows_the_first_token_once_etcd_answers_and_after_a_second_rotation(monkeypatch):
    """A rotation's claim that met etcd away was not tried again: the mark stayed the old
    token's, and once the old token was out, a master restarted with the new one alone would
    not stand. Nor was a second rotation's, while the first's claim was under way."""
    monkeypatch.setattr(limits, "CLUSTER_MARK_RETRY_MS", 20)
    old, new, third = (auth.cluster_mark(auth.cluster_key(t)) for t in (OLD, NEW, "a-third-token-0123456789abcdef"))

    async def main() -> None:
        config = ElectionConfig(("127.0.0.1:1",), "rotating", cluster_mark=old)
        elector = Elector(config, LeaderRecord("127.0.0.1:2", "127.0.0.1:3", "c"), listener=None)  # type: ignore[arg-type]
        etcd = elector._etcd = _FlakyEtcd(old, failures=3)  # type: ignore[assignment]
        elector.rotate_marks([new, old])
        elector.rotate_marks([third, new, old])  # while the first claim waits for etcd
        for _ in range(200):
            if etcd.held == third:
                break
            await asyncio.sleep(0.01)
        assert etcd.held == third and etcd.failures == 0
        await asyncio.sleep(0.1)
        assert etcd.held == third  # no later claim brought an older mark back

    asyncio.run(main())


def test_a_claim_of_the_older_mark_that_lands_after_a_rotations_claim_is_made_again() -> None:
    """A master's claim at start with its first token's mark (etcd held another of its tokens'
    mark: it puts its own back), a rotation's claim beside it: the start's put landed last, and
    etcd kept the older mark (review helper-154). A claim now sees the tokens replaced during
    it and claims again with the latest."""
    old, new = (auth.cluster_mark(auth.cluster_key(t)) for t in (OLD, NEW))

    class HeldPut(_FlakyEtcd):
        """The first put waits until `released` (a slow answer)."""

        def __init__(self, held: str) -> None:
            super().__init__(held, failures=0)
            self.released, self.puts = asyncio.Event(), 0

        async def put(self, key: bytes, value: bytes, *, lease_id: int = 0) -> int:
            self.puts += 1
            if self.puts == 1:
                await self.released.wait()
            return await super().put(key, value, lease_id=lease_id)

    async def main() -> None:
        config = ElectionConfig(("127.0.0.1:1",), "rotating", cluster_mark=old, also_marks=(new,))
        elector = Elector(config, LeaderRecord("127.0.0.1:2", "127.0.0.1:3", "c"), listener=None)  # type: ignore[arg-type]
        etcd = elector._etcd = HeldPut(new)  # type: ignore[assignment]
        starting = asyncio.create_task(elector._claim_cluster())  # puts the old mark back: held
        while not etcd.puts:
            await asyncio.sleep(0.001)
        elector.rotate_marks([new, old])  # etcd holds the new one yet: this claim writes nothing
        await elector._claiming
        etcd.released.set()
        await starting
        assert etcd.held == new

    asyncio.run(main())


# --- real processes -------------------------------------------------------------------------------


def accepts(endpoint: str, token: str) -> bool:
    """Whether the server at `endpoint` completes a handshake with `token`."""

    async def handshake() -> bool:
        try:
            conn = await connect(endpoint, key=auth.cluster_key(token), timeout_ms=5_000)
        except Unauthorized:
            return False
        conn.close("checked")
        return True

    return asyncio.run(handshake())


def rotate(cluster, text: str, count: int) -> None:
    """Write the cluster's token file, signal every process of it, and wait until each said it
    took the tokens (`count`: the times it has said so for as many tokens)."""
    (cluster.workdir / "token").write_text(text)
    processes = [cluster.master, *cluster.nodes]
    for process in processes:
        process.signal(signal.SIGUSR1)
    said = f"cluster tokens replaced: {len(text.split())} accepted"
    for process in processes:
        assert wait_until(lambda: process.log_path.read_text().count(said) == count, 10), process.log_path


def test_a_token_rotated_in_then_out_with_sigusr1_keeps_every_process_and_object(make_cluster, request):
    cluster = make_cluster(2, "16MiB", token=OLD)
    servers = [cluster.master_endpoint, *(node.info["endpoint"] for node in cluster.nodes)]
    processes = [cluster.master, *cluster.nodes]
    options = {"shm_enabled": False}  # every read and write through the nodes' TCP handshakes

    def put_and_read(token: str, prefix: str, expected: dict[str, bytes]) -> None:
        values = {f"{prefix}/{i}": os.urandom(64 * 1024) for i in range(8)}
        with Store(cluster.master_endpoint, token=token, **options) as store:
            assert store.put_batch(list(values), list(values.values())) == [ErrorCode.OK] * len(values)
            expected.update(values)
            assert store.get_batch(list(expected)) == list(expected.values())

    stored: dict[str, bytes] = {}
    put_and_read(OLD, "before", stored)
    with Store(cluster.master_endpoint, token=OLD) as store:
        segments = sorted(s.segment.segment_id for s in store.cluster_status().segments)
    assert not any(accepts(server, NEW) for server in servers)

    # 1. The new token accepted everywhere; the old one still what every process connects with.
    rotate(cluster, f"{OLD}\n{NEW}\n", 1)
    assert all(accepts(server, NEW) for server in servers)
    put_and_read(NEW, "accepted", stored)
    put_and_read(OLD, "still-old", stored)
    # A serving engine started now reads both lines: it connects with the old token, and keeps
    # the new one for when a server refuses the old (auth.Keyring).
    riding = Store(cluster.master_endpoint, token=OLD, other_tokens=(NEW,), **options)
    request.addfinalizer(riding.close)  # idempotent
    assert riding.get_batch(list(stored)) == list(stored.values())

    # 2. The new token first: the master signs grants with it, nodes connect with it; clients
    # still on the old one are served (restart them with the new one meanwhile).
    rotate(cluster, f"{NEW}\n{OLD}\n", 2)
    put_and_read(OLD, "old-client", stored)  # its grants are the new token's: the nodes take them
    put_and_read(NEW, "first", stored)

    # 3. The old token out, at least the grants' life (30 s) after step 2 in a real rotation
    # (a grant the master signed before step 2 is refused by a node past step 3): whoever holds
    # the old token is cut off, connected or not.
    with Store(cluster.master_endpoint, token=OLD, **options) as leaked:
        assert leaked.get_batch(list(stored)) == list(stored.values())  # connected to the master and nodes
        rotate(cluster, f"{NEW}\n", 1)
        with pytest.raises(Unauthorized, match="wrong cluster token"):
            leaked.get_batch(list(stored))
    assert not any(accepts(server, OLD) for server in servers)
    said = cluster.master.log_path.read_text()  # type: ignore[union-attr]
    closed = re.search(r"1 accepted, grants signed with the first \(mark \w+\); (\d+) connections closed", said)
    assert closed and int(closed.group(1)) >= 3, closed  # the two nodes' links and the leaked store's
    with Store(cluster.master_endpoint, token=NEW) as store:
        # The nodes' links to the master proved the old token at their start: closed, they
        # connect again with the new one and mount the same segments, objects and all.
        def mounted() -> list[tuple[str, str]]:
            return sorted((s.segment.segment_id, s.state) for s in store.cluster_status().segments)

        assert wait_until(lambda: mounted() == [(segment, "active") for segment in segments], 15), mounted()
    put_and_read(NEW, "after", stored)
    with riding:  # never restarted: its connections closed at step 3, it connected with the new token
        assert riding.get_batch(list(stored)) == list(stored.values())
        riding.put("riding", b"r" * 1000)
        assert riding.get("riding") == b"r" * 1000
    assert all(process.is_alive() for process in processes)  # type: ignore[union-attr]


def test_a_store_contributing_a_segment_rides_through_every_step(make_cluster, request):
    """An engine's connector may contribute a segment of its own (embedded_memory_bytes). Its
    node took only the token the store connected with: past step 2 (grants signed with the new
    token) no put could land on a segment of a store opened after step 1, one opened after
    step 2 refused the clients still on the old token, and at step 3 the first one's node was
    refused for good, its objects gone from the cluster (review helper-154). It shares the
    store's keys now, connecting with the next one once refused, as the store does."""
    cluster = make_cluster(0, token=OLD)  # the stores' segments are the cluster's only ones
    options = {"shm_enabled": False, "embedded_memory_bytes": 16 * limits.MIB}
    rotate(cluster, f"{OLD}\n{NEW}\n", 1)
    early = Store(cluster.master_endpoint, token=OLD, other_tokens=(NEW,), **options)  # opened after step 1
    request.addfinalizer(early.close)
    rotate(cluster, f"{NEW}\n{OLD}\n", 2)
    late = Store(cluster.master_endpoint, token=NEW, other_tokens=(OLD,), **options)  # after step 2
    request.addfinalizer(late.close)
    stored: dict[str, bytes] = {}
    for store in (early, late):  # a put onto each store's own segment, with a grant of the new token
        segment_id = store.embedded_segment.segment_id  # type: ignore[union-attr]
        key, value = f"on/{segment_id}", os.urandom(64 * 1024)
        store.put(key, value, ReplicateConfig(preferred_segments=[segment_id]))
        stored[key] = value
    for token in (OLD, NEW):  # clients on either token are served until step 3
        with Store(cluster.master_endpoint, token=token, shm_enabled=False) as reader:
            assert reader.get_batch(list(stored)) == list(stored.values()), token

    rotate(cluster, f"{NEW}\n", 1)  # the early store's node and master links proved the old token: closed
    with Store(cluster.master_endpoint, token=NEW, shm_enabled=False) as reader:
        segments = sorted(store.embedded_segment.segment_id for store in (early, late))  # type: ignore[union-attr]

        def mounted() -> list[tuple[str, str]]:
            return sorted((s.segment.segment_id, s.state) for s in reader.cluster_status().segments)

        assert wait_until(lambda: mounted() == [(segment, "active") for segment in segments], 15), mounted()
        assert reader.get_batch(list(stored)) == list(stored.values())
    early.put("after", b"a" * 1000)
    assert early.get("after") == b"a" * 1000


def test_a_master_given_new_tokens_while_its_dfs_opens_marks_the_dfs_with_them(tmp_path, monkeypatch):
    """A SIGUSR1 while a master's start opened its DFS (a share slow to answer) changed the
    tokens, and the DFS kept the mark of the old first one: the line an operator waits for
    before step 3 never came, and a master restarted with the new token alone refused the DFS
    (review helper-154). The server in this process, its DFS a real directory."""
    from kvpool.config import MasterConfig
    from kvpool.master import server as master_server

    opened = asyncio.Event()
    open_dfs = master_server.DfsDirectory.create_or_open

    def slow_open(*args, **kwargs):
        loop.call_soon_threadsafe(opened.set)
        time.sleep(0.3)  # the signal comes meanwhile
        return open_dfs(*args, **kwargs)

    monkeypatch.setattr(master_server.DfsDirectory, "create_or_open", staticmethod(slow_open))
    new_mark = auth.cluster_mark(auth.cluster_key(NEW))

    async def start_and_rotate() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        master = master_server.MasterServer(
            MasterConfig(), port=0, token=OLD, accepted_tokens=[NEW], dfs_dir=str(tmp_path), dfs_bytes=64 * limits.MIB
        )
        starting = asyncio.create_task(master.start())
        await opened.wait()
        master.replace_tokens([NEW, OLD])  # step 2's SIGUSR1, during the start
        await starting
        try:
            async with asyncio.timeout(10):
                while files.load_identity(tmp_path).owner != new_mark:
                    await asyncio.sleep(0.05)
        finally:
            await master.stop()

    loop: asyncio.AbstractEventLoop | None = None
    asyncio.run(start_and_rotate())


def test_other_tokens_without_a_token_to_connect_with_first_are_refused(monkeypatch) -> None:
    """They were dropped unsaid, and a cluster with a token then refused a client that sent none."""
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    with pytest.raises(InvalidParams, match="other_tokens without a token"):
        ClientConfig(other_tokens=(NEW,))
    with pytest.raises(InvalidParams, match="other_tokens without a token"):
        ClientConfig(token="", other_tokens=(NEW,))
    with pytest.raises(InvalidParams, match="empty token"):
        ClientConfig(token=OLD, other_tokens=("",))


def test_a_token_file_that_cannot_be_read_at_sigusr1_leaves_the_tokens_as_they_were(make_cluster):
    """An empty file (a secret half rotated, a typo) would otherwise leave a master with no
    token: it keeps the ones it had, says why, and the next good file is taken."""
    cluster = make_cluster(0, token=OLD)
    token_file = cluster.workdir / "token"
    token_file.write_text("\n")
    os.kill(cluster.master.pid, signal.SIGUSR1)  # type: ignore[union-attr]
    log = cluster.workdir / "master.log"
    assert wait_until(lambda: "cluster tokens not replaced (SIGUSR1)" in log.read_text(), 10), log.read_text()
    assert "is empty (or only comments); the ones before stay" in log.read_text()
    assert accepts(cluster.master_endpoint, OLD) and not accepts(cluster.master_endpoint, NEW)
    token_file.write_text(NEW)
    os.kill(cluster.master.pid, signal.SIGUSR1)  # type: ignore[union-attr]
    assert wait_until(lambda: accepts(cluster.master_endpoint, NEW), 10)
    assert not accepts(cluster.master_endpoint, OLD)


def test_the_cluster_marks_in_etcd_and_the_dfs_follow_the_first_token(make_cluster, etcd_endpoint, tmp_path):
    """etcd and the DFS directory record which token the cluster's masters share (a master with
    another token refuses to stand; a master of another cluster refuses the directory). After
    a rotation they name the new first token, so that a master restarted with it alone is the
    cluster's: a rotation must not turn the next restart into a refusal."""
    cluster_id, dfs = new_cluster_id(), tmp_path / "dfs"
    cluster = make_cluster(
        1, "16MiB", etcd_endpoint=etcd_endpoint, cluster_id=cluster_id, token=OLD,
        master_args=("--etcd-lease-ttl-ms", str(TTL_MS), "--dfs-dir", str(dfs), "--dfs-size", "64MiB"),
    )  # fmt: skip
    cluster.wait_leader()
    old_mark, new_mark = (auth.cluster_mark(auth.cluster_key(token)) for token in (OLD, NEW))

    def etcd_mark() -> str:
        async def read() -> str:
            async with EtcdClient((etcd_endpoint,)) as etcd:
                held, _ = await etcd.get(mark_key(cluster_id))
            return held.value.decode() if held is not None else ""

        return asyncio.run(read())

    def dfs_owner() -> str:
        identity = files.load_identity(dfs)
        return identity.owner if identity is not None else ""

    assert etcd_mark() == old_mark and dfs_owner() == old_mark
    (cluster.workdir / "token").write_text(f"{NEW}\n{OLD}\n")
    cluster.master.signal(signal.SIGUSR1)  # type: ignore[union-attr]
    assert wait_until(lambda: etcd_mark() == new_mark and dfs_owner() == new_mark, 10), (etcd_mark(), dfs_owner())
    with Store(cluster.master_address, token=OLD) as store:  # the old token is still accepted
        store.put("still", b"s" * 100)
        assert store.get("still") == b"s" * 100


@pytest.mark.parametrize(
    "command", [("-c", "from kvpool.cli import main; main()"), ("-m", "kvpool.cli.main")], ids=["kvpool", "python-m"]
)
def test_sigusr1_while_the_command_starts_does_not_end_it(tmp_path, command) -> None:
    """SIGUSR1's default ends a process: one sent to every kvpool process of a host in a
    rotation killed a master or node whose modules were still loading, before it took the
    signal (review helper-154). The `kvpool` command (and `python -m kvpool.cli.main`, as
    LocalCluster starts servers: review helper-156) ignores it from its first lines until the
    server takes it; /proc says when it does."""
    log_path = tmp_path / "master.log"
    with log_path.open("w") as log:
        args = [sys.executable, *command, "master", "--port", "0", "--http-port", "0"]
        master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        def sigusr1_is(mask: str) -> bool:  # "SigIgn": ignored, "SigCgt": a handler's
            status = Path(f"/proc/{master.pid}/status").read_text()
            bits = int(re.search(rf"^{mask}:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
            return bool(bits & (1 << (signal.SIGUSR1 - 1)))

        # From the command's first line (its modules take 0.1-0.5 s to load) until the server's
        # handler: looked at every millisecond, the ignored state is seen before the handler.
        deadline = time.monotonic() + 10
        while not sigusr1_is("SigIgn"):
            assert not sigusr1_is("SigCgt") and time.monotonic() < deadline, "SIGUSR1 was never ignored"
            time.sleep(0.001)
        while "master listening on" not in log_path.read_text():  # signalled all through its start
            assert master.poll() is None, log_path.read_text()
            master.send_signal(signal.SIGUSR1)
            time.sleep(0.005)
        master.send_signal(signal.SIGUSR1)  # once it serves, the server's to take
        assert wait_until(lambda: "SIGUSR1 reads the token file again" in log_path.read_text(), 10)
        assert master.poll() is None
    finally:
        master.terminate()
        master.wait(10)


def test_sigusr1_without_a_token_file_says_so_and_changes_nothing(make_cluster):
    """A master whose token (none here; or KVPOOL_TOKEN's) is not from a file has nothing to
    read again: it logged "cluster tokens replaced: 0 accepted", as if something was."""
    cluster = make_cluster(1, "16MiB")
    cluster.master.signal(signal.SIGUSR1)  # type: ignore[union-attr]
    log = cluster.master.log_path  # type: ignore[union-attr]
    assert wait_until(lambda: "SIGUSR1 reads the token file again, and there is none" in log.read_text(), 10)
    assert "tokens replaced" not in log.read_text() and cluster.master.is_alive()  # type: ignore[union-attr]
    with Store(cluster.master_endpoint, token="") as store:
        store.put("still", b"s" * 100)
        assert store.get("still") == b"s" * 100
