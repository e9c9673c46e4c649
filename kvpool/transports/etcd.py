"""An etcd v3 client over etcd's JSON gateway: the few calls kvpool's HA needs.

`EtcdClient` speaks to etcd's gRPC-gateway (`POST /v3/kv/range`, `/v3/kv/txn`,
`/v3/lease/grant|keepalive|revoke`, `/v3/watch`), which every etcd since 3.4 serves on its
client port, with aiohttp, already a kvpool dependency. It holds nothing but endpoints and an
HTTP session; every call is bounded by a timeout per endpoint tried, and every failure comes
out as a kvpool error: etcd unreachable is `ConnectFailed` or `RpcTimeout` (OSError and aiohttp's
errors are mapped here, at the transport edge, and nowhere else), an error answered by etcd is
`CoordinationError`. It is not an election (master/election.py) nor discovery (discovery.py).

Why the JSON gateway rather than a gRPC client library: the `etcd3` package is unmaintained
since 2020 and its generated code fails to import with protobuf >= 4 (protobuf's "Descriptors
cannot be created directly"); gRPC-based successors (`aetcd`, `etcd-sdk-python`) pull grpcio
and protobuf into every client process of a serving cluster, pinned to their own generated
code; `etcd3gw` talks to the same gateway as this module but with blocking `requests`, which
an asyncio master would have to push onto threads. The gateway is etcd's documented v3 API
(etcd.io "gRPC gateway"), byte-for-byte the same operations as gRPC, and kvpool uses a
handful of them, so a hundred lines over aiohttp is the smaller, better-kept dependency.

Wire conventions of the gateway: keys and values are base64, 64-bit integers are decimal
strings, and fields at their zero value are omitted (a failed txn has no "succeeded").
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvpool import limits
from kvpool.errors import ConnectFailed, CoordinationError, InvalidParams, RpcTimeout

_API_PREFIX = "/v3/"
# gRPC status NOT_FOUND: a lease that expired or was revoked.
_GRPC_NOT_FOUND = 5


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it. `lease_id` is 0 when the key is not attached to a lease."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease_id: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kv_from(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(raw.get("key", "")),
        value=base64.b64decode(raw.get("value", "")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease_id=int(raw.get("lease", 0)),
    )


def _revision_of(reply: dict[str, Any]) -> int:
    return int(reply.get("header", {}).get("revision", 0))


def parse_etcd_endpoints(text: str) -> tuple[str, ...]:
    """("host:port", ...) from "host:port[,host:port...]" (an http:// prefix is allowed).

    Raises:
        InvalidParams: empty, too many, or an endpoint without a numeric port.
    """
    endpoints = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://").rstrip("/")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidParams(f"not an etcd HOST:PORT: {part!r}")
        endpoints.append(part)
    if not endpoints:
        raise InvalidParams(f"no etcd endpoint in {text!r}")
    if len(endpoints) > limits.ETCD_ENDPOINTS_MAX:
        raise InvalidParams(f"more than {limits.ETCD_ENDPOINTS_MAX} etcd endpoints")
    return tuple(endpoints)


class EtcdClient:
    """Requests to an etcd cluster, one endpoint at a time, the last good one first.

    Use as an async context manager (or call `close()`): it owns one aiohttp session. Safe to
    share between tasks of one event loop.
    """

    def __init__(
        self, endpoints: Sequence[str], *, request_timeout_ms: int = limits.ETCD_REQUEST_TIMEOUT_MS
    ) -> None:
        assert endpoints, "an EtcdClient needs an endpoint"
        assert len(endpoints) <= limits.ETCD_ENDPOINTS_MAX, len(endpoints)
        assert request_timeout_ms > 0, request_timeout_ms
        self.endpoints = tuple(endpoints)
        self._request_timeout_ms = request_timeout_ms
        self._preferred = 0
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"<EtcdClient {','.join(self.endpoints)}>"

    @property
    def preferred_endpoint(self) -> str:
        """The endpoint tried first: the last one that answered (the first, until one did)."""
        return self.endpoints[self._preferred]

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # --- kv -------------------------------------------------------------------------------

    async def get(self, key: bytes, *, timeout_ms: int | None = None) -> tuple[KeyValue | None, int]:
        """The key (None when absent) and the store's revision at the read."""
        reply = await self._call("kv/range", {"key": _b64(key)}, timeout_ms)
        kvs = reply.get("kvs") or []
        return (_kv_from(kvs[0]) if kvs else None), _revision_of(reply)

    async def put(self, key: bytes, value: bytes, *, lease_id: int = 0) -> int:
        """Set the key; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        return _revision_of(await self._call("kv/put", body, None))

    async def delete(self, key: bytes) -> int:
        """Delete the key; returns how many keys went (0 or 1)."""
        reply = await self._call("kv/deleterange", {"key": _b64(key)}, None)
        return int(reply.get("deleted", 0))

    async def create(
        self, key: bytes, value: bytes, *, lease_id: int
    ) -> tuple[bool, KeyValue | None, int]:
        """Create the key attached to a lease, only if it does not exist (one txn).

        Returns:
            (created, the key as it was when not created, the store revision after the txn).
        """
        key64 = _b64(key)
        body = {
            "compare": [{"key": key64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": key64, "value": _b64(value), "lease": str(lease_id)}}],
            "failure": [{"request_range": {"key": key64}}],
        }
        reply = await self._call("kv/txn", body, None)
        revision = _revision_of(reply)
        if reply.get("succeeded"):
            return True, None, revision
        responses = reply.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        return False, (_kv_from(kvs[0]) if kvs else None), revision

    async def put_if_held(self, guard_key: bytes, lease_id: int, key: bytes, value: bytes) -> bool:
        """Set `key` only while `guard_key` is attached to `lease_id` (a leader's fenced write).

        Returns:
            False when the guard key is gone or held under another lease: nothing was written.
        """
        body = {
            "compare": [
                {"key": _b64(guard_key), "target": "LEASE", "result": "EQUAL", "lease": str(lease_id)}
            ],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        }
        reply = await self._call("kv/txn", body, None)
        return bool(reply.get("succeeded"))

    # --- leases -----------------------------------------------------------------------------

    async def grant_lease(self, ttl_ms: int) -> tuple[int, int]:
        """A new lease of about `ttl_ms` (whole seconds, at least 1 s).

        Returns:
            (lease id, TTL granted in ms): etcd may grant more than asked, never less.
        """
        ttl_s = max(1, -(-ttl_ms // 1000))
        reply = await self._call("lease/grant", {"TTL": str(ttl_s)}, None)
        lease_id = int(reply.get("ID", 0))
        granted_s = int(reply.get("TTL", 0))
        if lease_id == 0 or granted_s <= 0:
            raise CoordinationError(f"etcd granted no lease: {reply.get('error', reply)}")
        return lease_id, granted_s * 1000

    async def keep_alive(self, lease_id: int, *, timeout_ms: int | None = None) -> int:
        """Renew a lease once. Returns its TTL in ms from now, 0 when it no longer exists."""
        reply = await self._call("lease/keepalive", {"ID": str(lease_id)}, timeout_ms)
        result = reply.get("result", reply)
        return max(0, int(result.get("TTL", 0))) * 1000

    async def revoke_lease(self, lease_id: int, *, timeout_ms: int | None = None) -> None:
        """Revoke a lease, deleting the keys attached to it. An unknown lease is not an error."""
        try:
            await self._call("lease/revoke", {"ID": str(lease_id)}, timeout_ms)
        except CoordinationError as exc:
            if getattr(exc, "grpc_code", None) != _GRPC_NOT_FOUND:
                raise

    # --- watch ------------------------------------------------------------------------------

    async def wait_for_change(self, key: bytes, after_revision: int, timeout_ms: int) -> bool:
        """Wait until `key` is modified or deleted after `after_revision`.

        Returns:
            True on a change (or when etcd cancelled the watch, e.g. the revision was compacted:
            the caller re-reads the key either way); False when `timeout_ms` passed first.

        Raises:
            ConnectFailed, RpcTimeout, CoordinationError: the watch could not be opened.
        """
        body = {"create_request": {"key": _b64(key), "start_revision": str(after_revision + 1)}}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        session = self._session_now()
        last_error: Exception | None = None
        for endpoint in self._rotation():
            if deadline <= loop.time():
                return False
            # A member answers a watch at once (its headers, then "created"): one that does not
            # within a request's timeout is frozen or gone, and the next is tried. It used to
            # get the whole wait, and a standby missed its leader's end for that long.
            is_open = False
            try:
                async with asyncio.timeout_at(min(deadline, loop.time() + self._request_timeout_ms / 1000)) as bound:
                    async with session.post(
                        f"http://{endpoint}{_API_PREFIX}watch",
                        json=body,
                        timeout=aiohttp.ClientTimeout(
                            total=None, sock_connect=self._request_timeout_ms / 1000
                        ),
                    ) as response:
                        if response.status != 200:
                            raise _answer_error(response.status, await _read_capped(response))
                        is_open = True
                        bound.reschedule(deadline)  # the stream stays open until a change
                        self._prefer(endpoint)
                        while True:  # Ends on an event, a cancel, or the deadline.
                            line = await response.content.readline()
                            if not line:
                                raise ConnectFailed(f"etcd {endpoint} closed the watch")
                            if len(line) > limits.ETCD_RESPONSE_SIZE_BYTES_MAX:
                                raise CoordinationError("etcd watch message too large")
                            result = _decode(line).get("result", {})
                            if result.get("canceled") or result.get("events"):
                                return True
            except TimeoutError:
                if is_open or deadline <= loop.time():
                    return False
                last_error = RpcTimeout(f"{endpoint} did not answer within {self._request_timeout_ms} ms")
                continue
            except (aiohttp.ClientError, OSError, ConnectFailed) as exc:
                last_error = exc
                continue
        raise ConnectFailed(f"no etcd endpoint of {self.endpoints} opened a watch: {last_error}")

    # --- internals --------------------------------------------------------------------------

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limits.ETCD_ENDPOINTS_MAX * 4)
            )
        return self._session

    def _rotation(self) -> list[str]:
        count = len(self.endpoints)
        return [self.endpoints[(self._preferred + i) % count] for i in range(count)]

    def _prefer(self, endpoint: str) -> None:
        self._preferred = self.endpoints.index(endpoint)

    async def _call(self, path: str, body: dict[str, Any], timeout_ms: int | None) -> dict[str, Any]:
        """POST to the first endpoint that answers.

        Each endpoint gets at most the client's request timeout. With `timeout_ms` the whole
        call ends by then: the first endpoint tried (the one that answered last) gets half of
        it when others follow, and each after it an equal share of what is left, so a slow
        member that answers keeps most of its time, and a frozen one leaves the next ones some.

        Raises:
            ConnectFailed: no endpoint could be reached.
            RpcTimeout: an endpoint was reached but did not answer in time (and no other did).
            CoordinationError: etcd answered with an error.
        """
        loop = asyncio.get_running_loop()
        deadline_s = None if timeout_ms is None else loop.time() + max(timeout_ms, 1) / 1000
        session = self._session_now()
        timed_out = False
        last_error: BaseException | None = None
        rotation = self._rotation()
        for tried, endpoint in enumerate(rotation):
            attempt_s = self._request_timeout_ms / 1000
            if deadline_s is not None:
                shares = 2 if tried == 0 and len(rotation) > 1 else len(rotation) - tried
                attempt_s = min(attempt_s, (deadline_s - loop.time()) / shares)
                if attempt_s <= 0:
                    timed_out = True
                    break
            try:
                async with session.post(
                    f"http://{endpoint}{_API_PREFIX}{path}", json=body, timeout=aiohttp.ClientTimeout(total=attempt_s)
                ) as response:
                    raw = await _read_capped(response)
                    if response.status != 200:
                        raise _answer_error(response.status, raw)
                    self._prefer(endpoint)
                    return _decode(raw)
            except TimeoutError as exc:
                timed_out, last_error = True, exc
            except (aiohttp.ClientError, OSError) as exc:
                last_error = exc
        where = ",".join(self.endpoints)
        if timed_out:
            bound_ms = self._request_timeout_ms if timeout_ms is None else timeout_ms
            raise RpcTimeout(f"etcd {where} did not answer {path} within {bound_ms} ms")
        raise ConnectFailed(f"etcd {where} unreachable for {path}: {last_error}")


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, up to ETCD_RESPONSE_SIZE_BYTES_MAX. (A read(n) returns what has come
    so far: a reply that crosses the network in several pieces needs several.)"""
    cap = limits.ETCD_RESPONSE_SIZE_BYTES_MAX
    raw = bytearray()
    while len(raw) <= cap and (piece := await response.content.read(cap + 1 - len(raw))):
        raw += piece
    if len(raw) > cap:
        raise CoordinationError(f"etcd reply larger than {cap} bytes")
    return bytes(raw)


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        reply = json.loads(raw)
    except ValueError as exc:
        raise CoordinationError(f"etcd sent something that is not JSON: {raw[:80]!r}") from exc
    if not isinstance(reply, dict):
        raise CoordinationError(f"etcd sent {type(reply).__name__}, expected an object")
    if "error" in reply and "result" not in reply and "header" not in reply:
        raise _answer_error(200, raw)
    return reply


def _answer_error(status: int, raw: bytes) -> CoordinationError:
    try:
        reply = json.loads(raw)
        message = str(reply.get("error") or reply.get("message") or reply)
        grpc_code = int(reply.get("code", 0))
    except (ValueError, AttributeError, TypeError):
        message, grpc_code = raw[:200].decode(errors="replace"), 0
    error = CoordinationError(f"etcd answered HTTP {status}: {message}")
    error.grpc_code = grpc_code  # type: ignore[attr-defined]
    return error


__all__ = ["EtcdClient", "KeyValue", "parse_etcd_endpoints"]
