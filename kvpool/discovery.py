"""Where the master is: a fixed HOST:PORT, or the leader that etcd names.

A master address is either a plain `HOST:PORT` (one master, no etcd: the default) or
`etcd://HOST:PORT[,HOST:PORT...][/CLUSTER_ID]`, the etcd cluster where master candidates elect
a leader (master/election.py). This module owns that syntax, the layout of kvpool's keys in
etcd, the leader record the leader writes there, and `MasterResolver`, which clients
(client/pool.py MasterLink) and nodes (node/server.py's master link) ask for the endpoint to
dial, and tell to forget it when the endpoint failed them. It is not a connection, holds no
connection, and does not retry: each caller keeps its own bounded retry loop.

    /kvpool/<cluster-id>/leader    {"endpoint": "host:port", "http": "host:port", "id": "..."}
                                   attached to the leader's lease: gone when the lease lapses
    /kvpool/<cluster-id>/segments  {"term": N, "segment_ids": [...]}, no lease: the segments
                                   live under the last leader, for its successor to wait for
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

from kvpool import limits
from kvpool.errors import CoordinationError, InvalidParams, NotLeader

ETCD_SCHEME = "etcd://"
_CLUSTER_ID_RE = re.compile(r"[A-Za-z0-9_.-]+")


def check_cluster_id(cluster_id: str) -> str:
    """The cluster id, if it is a valid one. Raises InvalidParams."""
    if not _CLUSTER_ID_RE.fullmatch(cluster_id) or len(cluster_id) > limits.CLUSTER_ID_SIZE_BYTES_MAX:
        raise InvalidParams(
            f"cluster id {cluster_id!r}: use up to {limits.CLUSTER_ID_SIZE_BYTES_MAX} letters, "
            "digits, '_', '.', '-'"
        )
    return cluster_id


def leader_key(cluster_id: str) -> bytes:
    return f"/kvpool/{cluster_id}/leader".encode()


def segments_key(cluster_id: str) -> bytes:
    return f"/kvpool/{cluster_id}/segments".encode()


def mark_key(cluster_id: str) -> bytes:
    """The mark of the cluster token its masters share (auth.cluster_mark): set by the first
    candidate, never leased; a candidate with another token refuses to stand (Elector)."""
    return f"/kvpool/{cluster_id}/mark".encode()


@dataclasses.dataclass(frozen=True)
class MasterAddress:
    """A parsed master address: `endpoint` for a fixed master, else etcd and a cluster id."""

    endpoint: str = ""
    etcd_endpoints: tuple[str, ...] = ()
    cluster_id: str = limits.CLUSTER_ID_DEFAULT

    @property
    def is_etcd(self) -> bool:
        return bool(self.etcd_endpoints)

    @property
    def probe_host(self) -> str:
        """A host on the way to the master (a node uses it to pick its advertised address)."""
        first = self.etcd_endpoints[0] if self.is_etcd else self.endpoint
        return first.rpartition(":")[0].strip("[]")

    def __str__(self) -> str:
        if self.is_etcd:
            return f"{ETCD_SCHEME}{','.join(self.etcd_endpoints)}/{self.cluster_id}"
        return self.endpoint


def parse_master_address(text: str) -> MasterAddress:
    """`HOST:PORT` or `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER_ID]`.

    Raises:
        InvalidParams: anything else.
    """
    text = text.strip()
    if text.startswith(ETCD_SCHEME):
        # Imported here: the etcd client brings aiohttp, a sixth of a second of every client
        # process's start, which a fixed master address never needs.
        from kvpool.transports.etcd import parse_etcd_endpoints

        rest = text[len(ETCD_SCHEME) :]
        hosts, _, cluster_id = rest.partition("/")
        cluster_id = cluster_id.strip("/") or limits.CLUSTER_ID_DEFAULT
        return MasterAddress("", parse_etcd_endpoints(hosts), check_cluster_id(cluster_id))
    host, sep, port = text.rpartition(":")
    # A list of masters is etcd's to keep (HA masters): "a:1,b:2" is one address mistyped.
    is_host = bool(host) and not any(c in host for c in ", \t/")
    if not sep or not is_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidParams(
            f"not a master address: {text!r} (HOST:PORT, or etcd://HOST:PORT[,...][/CLUSTER_ID])"
        )
    return MasterAddress(endpoint=text)


@dataclasses.dataclass(frozen=True)
class LeaderRecord:
    """What the leader key holds: how to reach the leader, and which candidate it is."""

    endpoint: str
    http_endpoint: str
    candidate_id: str

    def encode(self) -> bytes:
        return json.dumps(
            {"endpoint": self.endpoint, "http": self.http_endpoint, "id": self.candidate_id}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaderRecord:
        """Raises CoordinationError: not a leader record."""
        try:
            fields = json.loads(raw)
            return cls(str(fields["endpoint"]), str(fields.get("http", "")), str(fields.get("id", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CoordinationError(f"the leader key holds no leader record: {raw[:80]!r}") from exc


def encode_segments_record(term: int, segment_ids: list[str]) -> bytes:
    assert len(segment_ids) <= limits.LEADER_RECORD_SEGMENTS_MAX, len(segment_ids)
    return json.dumps({"term": term, "segment_ids": sorted(segment_ids)}).encode()


def decode_segments_record(raw: bytes) -> list[str]:
    """Raises CoordinationError: not a segment record."""
    try:
        ids = json.loads(raw)["segment_ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CoordinationError(f"the segments key holds no segment record: {raw[:80]!r}") from exc
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise CoordinationError("the segment record's ids are not strings")
    return ids


class MasterResolver:
    """The endpoint to dial for the master, remembered until the caller says it failed.

    For a fixed address this is just the address. For etcd it is the leader record's endpoint,
    read once and kept until `forget()`: a healthy link costs etcd nothing. Not thread-safe;
    one per link, used from one event loop.
    """

    def __init__(self, address: MasterAddress | str) -> None:
        self.address = parse_master_address(address) if isinstance(address, str) else address
        self._endpoint = "" if self.address.is_etcd else self.address.endpoint
        # The etcd endpoints, the one that answered the last lookup first: a member that is
        # down or cut off costs one lookup its share of the time, not every lookup.
        self._etcd_endpoints = self.address.etcd_endpoints

    def __repr__(self) -> str:
        return f"<MasterResolver {self.address} -> {self._endpoint or '?'}>"

    @property
    def is_dynamic(self) -> bool:
        """True when the master can move (etcd): a failed endpoint is worth re-resolving."""
        return self.address.is_etcd

    @property
    def retry_backoff_ms_max(self) -> int:
        """How long a link should wait at most between attempts: with etcd a new leader may
        appear at any moment, so it looks again sooner."""
        if self.is_dynamic:
            return limits.MASTER_RESOLVE_BACKOFF_MS_MAX
        return limits.RECONNECT_BACKOFF_MS_MAX

    async def resolve(self, timeout_ms: int) -> str:
        """The master's "host:port".

        Raises:
            NotLeader: etcd names no leader for the cluster (an election is under way).
            ConnectFailed, RpcTimeout, CoordinationError: etcd could not be asked.
        """
        if self._endpoint:
            return self._endpoint
        from kvpool.transports.etcd import EtcdClient  # see parse_master_address

        address, endpoints = self.address, self._etcd_endpoints
        async with EtcdClient(endpoints) as etcd:
            try:
                deadline_s = time.monotonic() + timeout_ms / 1000
                kv, _ = await etcd.get(leader_key(address.cluster_id), timeout_ms=timeout_ms)
                mark = None
                if kv is None:  # an election under way, or a cluster no master ever stood for
                    left_ms = max(1, int((deadline_s - time.monotonic()) * 1000))
                    mark, _ = await etcd.get(mark_key(address.cluster_id), timeout_ms=left_ms)
            finally:
                at = endpoints.index(etcd.preferred_endpoint)
                self._etcd_endpoints = endpoints[at:] + endpoints[:at]
        if kv is None:
            where = f"cluster {address.cluster_id!r} in etcd {','.join(address.etcd_endpoints)}"
            if mark is None:
                raise NotLeader(f"no master ever stood for {where}: is the cluster id right? (the masters' "
                                "--cluster-id; an etcd:// address without one names 'default')")  # fmt: skip
            raise NotLeader(f"no master is the leader of {where} (election under way?)")
        record = LeaderRecord.decode(kv.value)
        parse_master_address(record.endpoint)  # A malformed record fails here, not in connect.
        self._endpoint = record.endpoint
        return self._endpoint

    def forget(self) -> None:
        """The resolved endpoint failed the caller: ask etcd again next time."""
        if self.is_dynamic:
            self._endpoint = ""


__all__ = [
    "ETCD_SCHEME",
    "LeaderRecord",
    "MasterAddress",
    "MasterResolver",
    "check_cluster_id",
    "decode_segments_record",
    "encode_segments_record",
    "leader_key",
    "parse_master_address",
    "segments_key",
]
