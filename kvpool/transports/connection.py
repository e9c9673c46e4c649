"""One connection carrying kvpool frames both ways: the only asyncio I/O shell of the RPC.

Every process (master, node, client) talks through `Connection`: it authenticates the peer,
sends requests and awaits their replies by request id, and dispatches the peer's requests to a
`RequestHandler`. Either side may send requests (the master calls nodes on the connection the
node opened). Payload bytes are received straight into buffers the handler or the requester
names (asyncio.BufferedProtocol + frames.FrameDecoder), and sent with `writelines` of
memoryviews, never joined into a Python bytes object. A reply payload may also name ranges of
files (files.FileRange, the disk tier's reads): such a frame is sent by os.sendfile from a
worker thread, and the frames after it wait their turn (see `_write_frame`).

Same host, a connection moves to a Unix-domain socket: every server also listens on an
abstract-namespace Unix socket with a random name, announced in its first frame on TCP, and a
client that asks for it (`connect(prefer_local=True)`) dials that name and keeps the TCP
connection only if it cannot. The client dials it only when the server says it runs on the
same kernel and in the same network namespace, where the server bound the name itself
(transports/same_host.py: an abstract name is anyone's to bind), and only once the TCP
handshake's proof, which covers the name and the host (protocol/auth.py), holds: a relay
cannot name a socket of its own. The handshake there is the same. On this
project's VM a loopback TCP send costs ~30 µs of the sender's CPU and a round trip ~135 µs,
a Unix one ~4 µs and ~60 µs (`benchmarks/bench_core.py` records both), so the control
traffic of a same-host master and node (put_start, put_end, commits) goes twice as fast.

It is not a pool (pool.py) and holds no policy: timeouts and retries belong to callers, except
that a reply that misses its deadline while its payload is landing in a caller's buffer closes
the connection, so no late byte can ever reach a buffer the caller got back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import logging
import os
import resource
import socket
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

from kvpool import limits
from kvpool.errors import (
    ConnectFailed,
    InvalidParams,
    KVPoolError,
    ProtocolError,
    RemoteProtocolError,
    RpcFailed,
    RpcTimeout,
    Unauthorized,
    error_from_code,
    map_exceptions,
)
from kvpool.process import ThreadPool
from kvpool.protocol import auth
from kvpool.protocol.frames import (
    NEED_DATA,
    PADDED_PAYLOAD_BYTES_MIN,
    Frame,
    FrameDecoder,
    FrameSeal,
    PayloadDone,
    WireVersionMismatch,
    buffer_address,
    encode_frame,
    payload_tag,
    version_notice,
)
from kvpool.protocol.messages import (
    AuthChallenge,
    AuthOk,
    AuthResponse,
    ErrorReply,
    Message,
)
from kvpool.repeated_log import RepeatedLog
from kvpool.transports import files, same_host
from kvpool.transports.busy_poll import BusyPoll
from kvpool.transports.files import FileRange

# Threads that send file-backed frames (sendfile blocks on the disk): one frame per connection
# at a time, so this bounds the disk reads in flight per process.
FILE_SENDER_THREADS = 8
_file_senders = ThreadPool(FILE_SENDER_THREADS, "kvpool-sendfile")

# What a handshake that never comes may mean: a server's first frame comes at once.
NO_HANDSHAKE_WHY = "(a stalled server, or not a kvpool port: an HTTP or etcd port waits for a request)"

log = logging.getLogger(__name__)
# Peers refused before their handshake (wrong token, none in time, not kvpool's protocol).
_refused_peers = RepeatedLog(log, logging.WARNING)
# Peers that came without a token to a server that has one: its own line, so that an operator
# asking why a client does not connect finds it even under a flood of the others.
_tokenless_peers = RepeatedLog(log, logging.WARNING)
_near_open_files_limit = RepeatedLog(log, logging.WARNING)
# Connections closed, and newcomers refused, because a server holds as many as it may
# (Connection._has_room).
_crowded_out = RepeatedLog(log, logging.WARNING)
_refused_for_room = RepeatedLog(log, logging.WARNING)

Payload = Sequence[memoryview | bytes | FileRange]
ReplySinks = Callable[[Message], Sequence[memoryview] | None]
# Given the reply of a request whose caller stopped waiting for it (Connection.request).
LateReply = Callable[[Message], None]
# Shown each piece of a reply's payload as it lands in the reply sinks (FrameDecoder).
OnLanded = Callable[[memoryview], None] | None
# The largest control message a peer may send before the handshake is over (its own are
# tens of bytes): one that is not authenticated yet buys no large buffer.
HANDSHAKE_CONTROL_SIZE_BYTES_MAX = 64 * limits.KIB
# The share of its open files limit a server's connections may hold, handshakes included; the
# rest is the process's own: its files (a node's disk tier reads hold one per object), its
# outgoing connections (a node's link to its master), its HTTP port. Without it, idle connections
# that a client never closed took every descriptor, and then nobody could connect, not even
# the master's own nodes.
CONNECTIONS_SHARE_OF_OPEN_FILES = 0.75
# A full server closes an idle connection only once it has been silent this long: a node speaks
# to its master at least this often (it heartbeats every second; a link not heard from for a
# third of the node TTL is not live), so a live node's link is never the one closed.
CROWDED_OUT_SILENT_MS_MIN = limits.NODE_TTL_MS_DEFAULT // 3
# How many of the least recently heard connections a full server looks at for an idle one.
CROWDED_OUT_SCAN_MAX = 64


class Reply(NamedTuple):
    """A reply with a payload, or with work to do once it is written. `landing`: where the
    peer's buffer for it starts (an address, taken modulo 4 KiB), when the request said
    (ReadSlices.landing); see `Connection._header`. `then`: called right after the frame is
    written (or dropped: the connection closed), in the same step of the loop, so no other
    request is handled in between: work the caller need not wait for, yet which every later
    request must see done (the master's put_end publishes its objects so)."""

    message: Message
    payload: Payload = ()
    landing: int | None = None
    then: Callable[[], None] | None = None


HandlerResult = Message | Reply


class RequestHandler(Protocol):
    """What a server (or a client that accepts calls) implements.

    A handler may also define `payload_refused(conn, message)`: the Connection calls it when
    it refuses a payload that `payload_sinks` accepted (their sizes do not match the frame's),
    so that whatever `payload_sinks` set up for it (a timer) ends there. It is optional: a
    handler that accepts no payload, or sets nothing up, needs none.
    """

    def payload_sinks(self, conn: Connection, message: Message) -> Sequence[memoryview] | None:
        """Buffers for the payload of `message`, adding up to exactly its size. Raise a
        KVPoolError to refuse it: the payload is then discarded and the error is the reply
        (`handle` is not called). Called before any payload byte is read. Once it returns,
        either `payload_received`, `payload_refused` (if defined) or `connection_closed`
        follows."""
        ...

    def handle(
        self, conn: Connection, message: Message
    ) -> HandlerResult | Awaitable[HandlerResult]:
        """The reply (and its payload) for a request without payload; raise KVPoolError for
        an error reply."""
        ...

    def payload_received(
        self, conn: Connection, message: Message
    ) -> HandlerResult | Awaitable[HandlerResult]:
        """The reply for a request whose payload has landed in the sinks `payload_sinks` gave."""
        ...

    def connection_closed(self, conn: Connection) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """An authenticated, multiplexed request/reply channel over one socket.

    Holds the pending requests (id -> future) this side sent, and the payload-bearing request
    of the peer whose bytes are arriving. Once closed it stays closed: every pending and later
    request fails with RpcFailed.
    """

    def __init__(
        self,
        handler: RequestHandler | None,
        *,
        key: bytes | None | auth.Keyring,
        is_server: bool,
        name: str = "",
        registry: set[Connection] | None = None,
        local_name: str = "",
        busy_poll: BusyPoll | None = None,
        replies_owed_max: int | None = None,
        handshaking: dict[Connection, None] | None = None,
        heard: OrderedDict[Connection, None] | None = None,
    ) -> None:
        self.name = name
        # Server side: the Unix socket name announced to TCP clients. Client side: the name the
        # server announced ("" when none, on a Unix connection, or not on this host).
        self.local_name = local_name
        self._registry = registry
        # A server's connections still in their handshake, oldest first (see _begin_handshake).
        self._handshaking = handshaking
        # A server's authenticated connections, least recently heard first, and when this one
        # last was (see _has_room).
        self._heard = heard
        self._heard_s = 0.0
        self.peer = ""
        self._handler = handler
        # A client's key (None: no token); a server's keyring (the keys it accepts).
        self._key = key if not isinstance(key, auth.Keyring) else None
        self._keyring = key if isinstance(key, auth.Keyring) else auth.Keyring()
        assert is_server == isinstance(key, auth.Keyring), "a server takes a Keyring, a client a key"
        self.proven_key: bytes | None = None  # a server's: the key its peer proved (Listener.close_unaccepted)
        self._is_server = is_server
        self._decoder = FrameDecoder()
        self._decoder.limit_control_size(HANDSHAKE_CONTROL_SIZE_BYTES_MAX)  # until authenticated
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._challenge: AuthChallenge | None = None  # the server's side of the handshake; a client's is here:
        self._handshake: auth.ClientHandshake | None = None
        self._seal: FrameSeal | None = None  # this side's frames' MAC, once authenticated with a token
        self._next_request_id = 1
        # Per request id: its future, reply sinks, late reply callback and `on_landed`.
        self._pending: dict[int, tuple[asyncio.Future[Message], ReplySinks | None, LateReply | None, OnLanded]] = {}
        # Requests whose caller stopped waiting, but whose reply still matters (request's
        # `late_reply`): what to hand that reply to when it comes. Oldest first, bounded.
        self._late_replies: dict[int, LateReply] = {}
        self._incoming: Message | None = None  # the peer's request whose payload is arriving
        self._incoming_id = 0
        self._incoming_reply: Message | None = None
        self._incoming_error: KVPoolError | None = None
        self._incoming_is_reply = False
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._pads_payloads = False  # a TCP socket: see _header
        # While a frame with file ranges is being sent from a thread: the frames queued behind
        # it (None otherwise), and the thread's dup() of the socket.
        self._held: list[list] | None = None
        self._sender_fd: int | None = None
        self._is_reading_paused = False  # a server's: see _update_reading
        self._replies_owed_max = replies_owed_max
        self._replies_preparing = 0  # requests an awaitable handler has not answered yet
        self._busy_poll = busy_poll  # a server's: polls on after each reply (busy_poll.py)
        # The frame being received, split across receives (_frame_begun): the timer of its
        # deadline, the frames decoded before it, and when its first bytes came.
        self._frame_timer: asyncio.TimerHandle | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None  # a server's, until the handshake
        self._frame_owed = -1
        self._frame_started_s = 0.0
        self.close_reason = ""

    def __repr__(self) -> str:
        state = "closed" if self.is_closed() else ("ready" if self._ready.done() else "handshake")
        return f"<Connection {self.name} {self.peer} {state} pending={len(self._pending)}>"

    # --- public API ---------------------------------------------------------------------

    def is_closed(self) -> bool:
        return self._closed.done()

    def inflight_count(self) -> int:
        return len(self._pending)

    def is_write_buffered(self) -> bool:
        """Whether some written bytes wait in this process (the kernel took not all yet)."""
        transport = self._transport
        return self._held is not None or (transport is not None and transport.get_write_buffer_size() > 0)

    async def wait_ready(self, timeout_ms: int) -> None:
        """Wait for the handshake. Raises ConnectFailed, Unauthorized or RpcTimeout."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that comes
            # in the loop step the awaited future completes, and the cancelled caller went on.
            async with asyncio.timeout(timeout_ms / 1000):
                await asyncio.shield(self._ready)
        except TimeoutError:
            self.close("handshake timed out")
            raise RpcTimeout(f"handshake with {self.peer} timed out after {timeout_ms} ms {NO_HANDSHAKE_WHY}") from None

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    async def request(
        self,
        message: Message,
        payload: Payload = (),
        *,
        reply_sinks: ReplySinks | None = None,
        timeout_ms: int = limits.RPC_TIMEOUT_MS_DEFAULT,
        landing: int | None = None,
        late_reply: LateReply | None = None,
        on_landed: OnLanded = None,
    ) -> Message:
        """Send a request and return its reply message.

        Args:
            message: the request.
            payload: buffers sent after the control message, in order.
            landing: where the peer lands the payload, if known (an address; see `_header`).
            reply_sinks: given the reply message, the buffers its payload goes into.
            timeout_ms: bound on the whole exchange.
            late_reply: given the reply (not an error, and without payload) if it comes after
                the caller was cancelled or timed out: for a reply that grants something the
                caller must give back. Called on the loop; it must not raise.
            on_landed: shown each piece of the reply's payload as it lands in the reply sinks
                (FrameDecoder.set_payload_sinks); it must not raise.

        Raises:
            RpcFailed: the connection is or becomes closed.
            RpcTimeout: no reply within timeout_ms (a late reply is dropped; if its payload was
                landing in the caller's buffers the connection is closed).
            KVPoolError subclass: the peer replied with an error code.
        """
        if self.is_closed():
            raise RpcFailed(f"connection to {self.peer} is closed: {self.close_reason}")
        if len(self._pending) >= limits.INFLIGHT_REQUESTS_PER_CONNECTION_MAX:
            raise RpcFailed(f"too many requests in flight to {self.peer}")
        request_id = self._take_request_id()
        future: asyncio.Future[Message] = self._loop.create_future()
        self._pending[request_id] = (future, reply_sinks, late_reply, on_landed)
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            future.cancel()

        # A plain timer instead of asyncio.wait_for: this is the hot path of every call.
        deadline_s = self._loop.time() + timeout_ms / 1000
        timer = self._loop.call_at(deadline_s, expire)
        try:
            await self._send(message, request_id, payload, landing, deadline_s)
            reply = await future
        except asyncio.CancelledError:
            if late_reply is not None:
                self._keep_for_late_reply(request_id, future, late_reply)
            if payload and self.is_write_buffered():
                # uvloop's writelines keeps the caller's buffers, not copies, until the kernel
                # takes them: the rest of the frame must not be read from memory the caller may
                # reuse (or free) once it has its error. Only closing stops it.
                self.close(f"{type(message).__name__} {'timed out' if expired else 'cancelled'} "
                           "while its payload was still being sent")  # fmt: skip
            if not expired:
                # The caller was cancelled. A reply whose payload is landing in its buffers
                # would go on writing there after the cancel returned: stop it (the only way
                # is to close the connection). One not started yet is dropped when it comes.
                if reply_sinks is not None and self._incoming_reply is not None and self._incoming_id == request_id:
                    self.close(f"{type(message).__name__} cancelled mid-transfer")
                raise
            if reply_sinks is not None:
                self.close(f"reply to {type(message).__name__} timed out mid-transfer")
            raise RpcTimeout(
                f"{type(message).__name__} to {self.peer} timed out after {timeout_ms} ms"
            ) from None
        finally:
            timer.cancel()
            self._pending.pop(request_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: a send that failed left it to _finish
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    def close(self, reason: str = "closed") -> None:
        """Abort the socket and fail everything pending. Idempotent."""
        if self._sender_fd is not None:
            # Wake the sending thread: its dup() would keep the socket open otherwise.
            with contextlib.suppress(OSError):
                probe = socket.socket(fileno=self._sender_fd)
                try:
                    probe.shutdown(socket.SHUT_RDWR)
                finally:
                    probe.detach()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()
        self._finish(reason)

    # --- asyncio.BufferedProtocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        if self._registry is not None:
            self._registry.add(self)
            _warn_near_open_files_limit(len(self._registry))
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            self.peer = "local"
        else:
            peer = transport.get_extra_info("peername")
            self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._pads_payloads = True
        if self._is_server:
            self._begin_handshake()
            self._challenge = AuthChallenge(
                os.urandom(limits.AUTH_NONCE_SIZE_BYTES), bool(self._keyring), self.local_name,
                same_host.host_identity() if self.local_name else "",
            )  # fmt: skip
            self._write_now(encode_frame(self._challenge, 0))

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(f"connection lost: {exc}" if exc else "connection closed by peer")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if not self._decoder.buffer_updated(nbytes):
            return
        self._process_buffered()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # --- internals ----------------------------------------------------------------------

    def _take_request_id(self) -> int:
        request_id = self._next_request_id
        self._next_request_id = request_id % limits.REQUEST_ID_MAX + 1
        return request_id

    def _is_backed_up(self) -> bool:
        """Whether enough replies wait to be sent (and, with `replies_owed_max`, to be
        prepared) that a server should read no more requests for now."""
        held = len(self._held) if self._held is not None else 0
        if self._replies_owed_max is not None:
            return self._replies_preparing + held >= self._replies_owed_max
        return self._held is not None and held >= limits.HELD_FRAMES_MAX

    def _update_reading(self) -> None:
        """A server reads no more requests from a peer that does not read its replies, or
        while it owes that peer too many (_is_backed_up): else their replies (and the files
        they hold open) pile up here without bound. It reads again once neither holds, the
        requests it had received first. (A client always reads: its replies are what lets
        the server go on, so it must not stop reading while it writes.)"""
        transport = self._transport
        if not self._is_server or transport is None or transport.is_closing():
            return
        is_backed_up = self._write_paused or self._is_backed_up()
        if is_backed_up == self._is_reading_paused:
            return
        self._is_reading_paused = is_backed_up
        if is_backed_up:
            transport.pause_reading()
        else:
            transport.resume_reading()
            self._loop.call_soon(self._process_buffered)  # what _process_events left for now

    def _process_buffered(self) -> None:
        try:
            self._process_events()
        except ProtocolError as exc:
            if isinstance(exc, WireVersionMismatch) and not self._is_server:
                self._write_now(version_notice())  # for the server to say why this peer went
            if self._ready.done():
                log.warning("closing connection %s %s: %s", self.name, self.peer, exc)
            elif self._is_server:  # an unauthenticated peer: a flood of them says it once in a while
                _refused_peers.log("closing connection %s %s: %s", self.name, self.peer, exc)
            else:  # a client's handshake that fails is its caller's error (wait_ready): not said twice
                log.debug("closing connection %s %s: %s", self.name, self.peer, exc)
            self.close(str(exc))

    def _write_now(self, data: bytes) -> None:
        self._write_frame([data])

    def _write_frame(self, parts: list) -> None:
        """Write one frame (header, then payload), in order with every other frame.

        A frame whose payload holds file ranges goes out from a worker thread (sendfile); the
        frames written meanwhile wait in `_held` and follow it, in order.
        """
        transport = self._transport
        assert transport is not None
        if self._held is not None:
            self._held.append(parts)
            if self._is_backed_up():
                self._update_reading()
        elif any(type(part) is FileRange for part in parts):
            self._held = []
            task = self._loop.create_task(self._send_file_frames(parts))
            task.add_done_callback(_log_task_failure)
        elif len(parts) == 1:
            transport.write(parts[0])
        else:
            transport.writelines(parts)

    async def _until_writable(self, fd: int, deadline_s: float) -> None:
        """Wait on the loop until socket `fd` takes bytes again (or is shut down: close()).

        Raises:
            RpcTimeout: not before `deadline_s` (loop time).
        """
        writable = self._loop.create_future()
        self._loop.add_writer(fd, lambda: writable.done() or writable.set_result(None))
        try:
            async with asyncio.timeout_at(deadline_s):  # not wait_for: see wait_ready
                await writable
        except TimeoutError:
            raise RpcTimeout("peer took no bytes before the transfer deadline") from None
        finally:
            self._loop.remove_writer(fd)

    async def _send_file_frames(self, parts: list) -> None:
        """Send a file-backed frame from a thread, then the held frames up to the next one."""
        transport = self._transport
        assert transport is not None
        try:
            while True:
                deadline_s = self._loop.time() + limits.TRANSFER_TIMEOUT_MS_DEFAULT / 1000
                # The thread writes to the socket itself: what the transport buffered goes first.
                while transport.get_write_buffer_size() and not self.is_closed():
                    if self._loop.time() > deadline_s:
                        raise RpcTimeout("peer took no bytes before the transfer deadline")
                    await asyncio.sleep(0.001)
                if self.is_closed():
                    return
                if type(parts[-1]) is files.PayloadTagOwed:  # read from the files: on a thread
                    parts[-1] = await self._loop.run_in_executor(
                        _file_senders.executor(), files.payload_tag_of, parts[-1].mac, parts[1:-1]
                    )
                    if self.is_closed():
                        return
                sock = transport.get_extra_info("socket")
                self._sender_fd = os.dup(sock.fileno())
                try:
                    # A thread sends while the socket takes bytes; room is awaited here, so
                    # that readers who stop reading hold no sender thread (8 of them held
                    # every one, up to 30 s each, and every other disk read waited).
                    position: files.SendPosition | None = files.SEND_START
                    while position is not None:
                        position = await self._loop.run_in_executor(
                            _file_senders.executor(), files.send_some, self._sender_fd, parts, position
                        )
                        if position is not None:
                            await self._until_writable(self._sender_fd, deadline_s)
                finally:
                    os.close(self._sender_fd)
                    self._sender_fd = None
                    files.close_parts(parts)
                    parts = []
                held, self._held = self._held or [], None
                for index, frame in enumerate(held):
                    if self._held is None and any(type(part) is FileRange for part in frame):
                        self._held = held[index + 1 :]
                        parts = frame
                        break
                    if not self.is_closed():
                        transport.writelines(frame)
                self._update_reading()
                if not parts:
                    return
        except (KVPoolError, OSError) as exc:
            log.warning("closing connection %s %s: sending a file failed: %s", self.name, self.peer, exc)
            self.close(f"sending a file failed: {exc}")
        finally:
            # A file frame not sent (the connection closed first, or the send failed) keeps
            # its descriptors open until released here; so do the frames that came back to
            # `_held` after the close released what it held then.
            files.close_parts(parts)
            if self.is_closed():
                held, self._held = self._held, None
                for frame in held or ():
                    files.close_parts(frame)

    async def _send(
        self, message: Message, request_id: int, payload: Payload, landing: int | None, deadline_s: float
    ) -> None:
        """Write a request, then wait while the peer reads too little (pause_writing), until
        `deadline_s` (loop time): the request's own bound, which the drain wait is part of.

        Raises:
            RpcFailed: the connection is or becomes closed.
            RpcTimeout: the peer did not drain the frame by the deadline; the connection is
                closed (the rest of the frame, and the caller's payload buffers it refers to,
                must not go out after the caller got its error).
        """
        if not self._ready.done():
            await asyncio.shield(self._ready)
        if self.is_closed() or self._transport is None:
            raise RpcFailed(f"connection to {self.peer} is closed: {self.close_reason}")
        self._write_frame(self._frame_parts(message, request_id, False, payload, landing))
        if self._write_paused:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline_s):  # not wait_for: see wait_ready
                    await waiter
            except TimeoutError:
                self.close(f"{type(message).__name__} not taken by the peer before its deadline")
                raise RpcTimeout(f"{type(message).__name__} to {self.peer}: the peer read nothing "
                                 "before the deadline") from None  # fmt: skip

    def _authenticated(self) -> None:
        self._decoder.limit_control_size(limits.FRAME_CONTROL_SIZE_BYTES_MAX)
        self._ready.set_result(None)
        self._cancel_handshake_timer()
        if self._heard is not None:
            self._heard[self] = None
            self._heard_s = self._loop.time()

    def _has_room(self) -> bool:
        """Whether a server takes this peer, which has just proved its token: it holds at most
        authenticated_connections_max() authenticated connections. At the bound, the least
        recently heard one that is idle and has been silent for CROWDED_OUT_SILENT_MS_MIN is
        closed, with a logged reason: connections a client opened and never closed crowd out
        their own kind, never a live node's link nor a connection in use (a client whose pooled
        connection went opens another at its next call). When none is, this peer is refused
        (closed before its handshake ends: it may retry): a burst of connections past the
        bound waits until the silent ones can go, and the established ones are served."""
        heard = self._heard
        if heard is None:
            return True
        connections_max = authenticated_connections_max()
        if len(heard) < connections_max:
            return True
        silent_since_s = self._loop.time() - CROWDED_OUT_SILENT_MS_MIN / 1000
        for scanned, conn in enumerate(heard):
            if scanned == CROWDED_OUT_SCAN_MAX or conn._heard_s > silent_since_s:
                break  # the rest were heard more recently still
            if conn._is_idle():
                _crowded_out.log(
                    "%s: closing %s, silent for %.0f s, the least recently heard of %d connections, the most "
                    "this server holds (%.0f%% of its open files limit, less room for handshakes), to take "
                    "%s: a client that does not close its connections?", conn.name, conn.peer,
                    self._loop.time() - conn._heard_s, len(heard), CONNECTIONS_SHARE_OF_OPEN_FILES * 100,
                    self.peer,
                )  # fmt: skip
                conn.close("closed to make room: the server holds as many connections as it may")
                return True
        _refused_for_room.log(
            "%s: refusing %s: this server holds %d connections, the most it may (%.0f%% of its open files "
            "limit, less room for handshakes), none idle and silent for %d ms: a client that does not "
            "close its connections?", self.name, self.peer, len(heard), CONNECTIONS_SHARE_OF_OPEN_FILES * 100,
            CROWDED_OUT_SILENT_MS_MIN,
        )  # fmt: skip
        self.close("refused: the server holds as many connections as it may")
        return False

    def _is_idle(self) -> bool:
        """Nothing under way either way: no request of this side's awaits its reply, no
        request of the peer's is being received, prepared or sent."""
        return (
            not self._pending
            and self._incoming is None
            and self._replies_preparing == 0
            and not self._decoder.is_mid_frame
            and not self.is_write_buffered()
        )

    def _keep_for_late_reply(self, request_id: int, future: asyncio.Future[Message], late_reply: LateReply) -> None:
        """The caller of `request_id` stopped waiting: hand its reply to `late_reply` when it
        comes, or now if it came first."""
        if future.done() and not future.cancelled():
            hand_late_reply(future.result(), late_reply)
        elif request_id in self._pending and not self.is_closed():  # not come yet (_on_frame)
            if len(self._late_replies) >= limits.INFLIGHT_REQUESTS_PER_CONNECTION_MAX:
                del self._late_replies[next(iter(self._late_replies))]  # the oldest: long overdue
            self._late_replies[request_id] = late_reply

    def _finish(self, reason: str) -> None:
        if self._closed.done():
            return
        self._late_replies.clear()
        if self._frame_timer is not None:
            self._frame_timer.cancel()
        self._cancel_handshake_timer()
        self.close_reason = reason
        self._closed.set_result(None)
        if self._registry is not None:
            self._registry.discard(self)
        if self._heard is not None:
            self._heard.pop(self, None)
        error = RpcFailed(f"connection to {self.peer} closed: {reason}")
        if not self._ready.done():
            self._ready.set_exception(ConnectFailed(f"{self.peer}: {reason}"))
            self._ready.exception()  # Mark retrieved: a failed handshake is reported by wait_ready.
        for future, *_ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        held, self._held = self._held, None
        for frame in held or ():
            files.close_parts(frame)  # never sent: release their files
        if self._handler is not None:
            self._handler.connection_closed(self)

    def _process_events(self) -> None:
        while not self.is_closed():
            # The requests received meanwhile wait (_update_reading takes them up), also those
            # already buffered when the peer stopped reading its replies: one receive holds
            # hundreds of small requests, and each reply (a ListObjects') may be megabytes.
            if self._is_server and (self._write_paused or self._is_backed_up()):
                return
            event = self._decoder.next_event()
            if event is NEED_DATA:
                if self._decoder.is_mid_frame:
                    self._frame_begun()
                return
            if isinstance(event, Frame):
                self._on_frame(event)
            else:
                assert isinstance(event, PayloadDone), event
                self._on_payload_done(event)

    def _frame_begun(self) -> None:
        """A frame is split across receives: it must be complete within FRAME_RECEIVE_TIMEOUT_MS
        of its first bytes, or the connection closes (a peer that sent part of a large control
        message and stalled held its buffer until it hung up). A frame is known by how many
        the decoder had returned before it; one timer at a time, set for the frame owed."""
        decoded = self._decoder.frames_decoded
        if decoded != self._frame_owed:
            self._frame_owed, self._frame_started_s = decoded, self._loop.time()
        if self._frame_timer is None:
            deadline_s = self._frame_started_s + limits.FRAME_RECEIVE_TIMEOUT_MS / 1000
            self._frame_timer = self._loop.call_at(deadline_s, self._frame_deadline)

    def _frame_deadline(self) -> None:
        self._frame_timer = None
        if self.is_closed() or not self._decoder.is_mid_frame:
            return
        if self._is_server and self._is_backed_up():
            # Its own replies still in the making: this side stopped reading, not the peer's
            # fault. (A peer that does not read its replies is no excuse: it stalls both ways.)
            self._frame_started_s = self._loop.time()
        elif self._frame_started_s + limits.FRAME_RECEIVE_TIMEOUT_MS / 1000 <= self._loop.time():
            reason = f"frame not complete within {limits.FRAME_RECEIVE_TIMEOUT_MS} ms of its first bytes"
            log.warning("closing connection %s %s: %s", self.name, self.peer, reason)
            self.close(reason)
            return
        self._frame_begun()  # a later frame owed (or an excused one): its own deadline

    def _on_frame(self, frame: Frame) -> None:
        message = frame.message
        if not self._ready.done():
            if frame.payload_size:  # nothing would take it, and the decoder waits for it
                raise RemoteProtocolError(f"{type(message).__name__} with a payload during the handshake")
            self._on_handshake(frame)
            return
        if isinstance(message, (AuthChallenge, AuthResponse, AuthOk)):
            raise RemoteProtocolError(f"unexpected {type(message).__name__} after the handshake")
        if self._heard is not None:
            self._heard.move_to_end(self)
            self._heard_s = self._loop.time()
        if frame.is_reply:
            entry = self._pending.get(frame.request_id)
            if entry is not None and entry[0].done() and not entry[0].cancelled():
                # Answered already, its caller not yet woken: a second reply's payload would
                # land in the caller's buffers after it returned with the first one.
                raise RemoteProtocolError(f"a second reply to request {frame.request_id}")
            if frame.payload_size:
                sinks = on_landed = None
                live = entry is not None and not entry[0].done()  # not cancelled meanwhile
                if live and entry[1] is not None and not isinstance(message, ErrorReply):
                    sinks, on_landed = entry[1](message), entry[3]
                self._decoder.set_payload_sinks(sinks, on_landed)
                self._incoming_id = frame.request_id
                self._incoming_reply = message
                self._incoming_is_reply = True
            elif entry is not None:
                if not entry[0].done():
                    entry[0].set_result(message)
                elif entry[2] is not None:  # its caller was cancelled, and has not woken yet
                    del self._pending[frame.request_id]
                    hand_late_reply(message, entry[2])
            elif (late_reply := self._late_replies.pop(frame.request_id, None)) is not None:
                hand_late_reply(message, late_reply)
            return
        if self._handler is None:
            raise RemoteProtocolError(f"peer sent a {type(message).__name__} request to a client")
        if frame.payload_size:
            sinks = None
            self._incoming_error = None
            try:
                sinks = self._handler.payload_sinks(self, message)
                if sinks is not None and sum(len(s) for s in sinks) != frame.payload_size:
                    # The handler accepted it and will never see it land: tell it (a node's
                    # grant timer armed for it closed the connection at its expiry, later).
                    if (refused := getattr(self._handler, "payload_refused", None)) is not None:
                        refused(self, message)
                    raise InvalidParams(
                        f"payload of {frame.payload_size} bytes does not match the request"
                    )
            except KVPoolError as exc:
                # At most a few hundred characters of it: the error may quote the peer's bytes.
                log.info("rejecting payload of %s from %s: %.300s", type(message).__name__, self.peer, exc)
                self._incoming_error = exc
                sinks = None
            self._decoder.set_payload_sinks(sinks)
            self._incoming = message
            self._incoming_id = frame.request_id
            self._incoming_is_reply = False
            self._incoming_reply = None
            return
        self._dispatch(frame.request_id, message)

    def _on_payload_done(self, event: PayloadDone) -> None:
        if self._incoming_is_reply:
            entry = self._pending.get(event.request_id)
            if entry is not None and not entry[0].done():
                assert self._incoming_reply is not None
                entry[0].set_result(self._incoming_reply)
            self._incoming_reply = None
            return
        message, self._incoming = self._incoming, None
        assert message is not None, "payload done without a request"
        if self._incoming_error is not None:
            # The payload was refused before it arrived and has been discarded.
            self._reply_error(event.request_id, self._incoming_error)
            return
        self._dispatch(event.request_id, message, has_payload=True)

    def _dispatch(self, request_id: int, message: Message, has_payload: bool = False) -> None:
        assert self._handler is not None
        try:
            if has_payload:
                result = self._handler.payload_received(self, message)
            else:
                result = self._handler.handle(self, message)
        except KVPoolError as exc:
            self._reply_error(request_id, exc)
            return
        except AssertionError:
            log.critical("invariant broken handling %s", type(message).__name__, exc_info=True)
            raise
        if isinstance(result, Awaitable):
            self._replies_preparing += 1
            if self._is_backed_up():
                self._update_reading()
            task = self._loop.create_task(self._reply_later(request_id, message, result))
            task.add_done_callback(_log_task_failure)
        else:
            self._reply(request_id, result, message)

    async def _reply_later(
        self, request_id: int, message: Message, result: Awaitable[HandlerResult]
    ) -> None:
        request: Message | None = message
        try:
            reply = await result
        except KVPoolError as exc:
            reply, request = ErrorReply(int(exc.code), str(exc)), None
        finally:
            self._replies_preparing -= 1
        self._reply(request_id, reply, request)
        self._update_reading()

    def _reply(self, request_id: int, result: HandlerResult, request: Message | None = None) -> None:
        message, payload, landing, then = result if isinstance(result, Reply) else (result, (), None, None)
        if self.is_closed():
            files.close_parts(payload)
        else:
            self._write_frame(self._frame_parts(message, request_id, True, payload, landing))
            if self._busy_poll is not None:
                self._busy_poll.replied(request, message)
        if then is not None:
            then()

    def _frame_parts(
        self, message: Message, request_id: int, is_reply: bool, payload: Payload, landing: int | None
    ) -> list:
        """What `_write_frame` sends of a frame: its header, its payload and, sealed, the
        payload's tag (or what the file-sending thread makes it from: PayloadTagOwed)."""
        parts = [self._header(message, request_id, is_reply, payload, landing), *payload]
        if self._seal is not None and _payload_size(payload):  # as the header says: parts may be empty
            mac = self._seal.payload_mac()
            if any(type(part) is FileRange for part in payload):
                parts.append(files.PayloadTagOwed(mac))
            else:
                parts.append(payload_tag(mac, payload))  # type: ignore[arg-type]
        return parts

    def _header(
        self, message: Message, request_id: int, is_reply: bool, payload: Payload, landing: int | None
    ) -> bytes:
        """The frame's header and control message. Over TCP, a payload that the kernel
        copies (not file ranges, sent with sendfile) gets its control message padded so that
        neither the copy from its first buffer nor the copy into `landing` runs at the slow
        offsets of frames.payload_padding."""
        payload_size = _payload_size(payload)
        source = None
        if self._pads_payloads and payload_size >= PADDED_PAYLOAD_BYTES_MIN and type(payload[0]) is not FileRange:
            source = buffer_address(payload[0])  # type: ignore[arg-type]
        else:
            landing = None
        return encode_frame(
            message, request_id, is_reply=is_reply, payload_size=payload_size,
            payload_source=source, payload_landing=landing, seal=self._seal,
        )  # fmt: skip

    def _reply_error(self, request_id: int, exc: KVPoolError) -> None:
        self._reply(request_id, ErrorReply(int(exc.code), str(exc)))

    def _on_handshake(self, frame: Frame) -> None:
        message = frame.message
        if self._is_server:
            if not isinstance(message, AuthResponse):
                raise RemoteProtocolError(f"expected AuthResponse, got {type(message).__name__}")
            if not self._keyring:
                if not self._has_room():
                    return
                self._write_now(encode_frame(AuthOk(b""), 0))
            else:
                challenge = self._challenge
                assert challenge is not None, "a server sends its challenge as the connection is made"
                if not message.mac:
                    _tokenless_peers.log("peer %s sent no token; this cluster requires one", self.peer)
                    self._refuse(message)
                    return
                key = self._keyring.proven_key(challenge.nonce, message.nonce, message.mac)
                if key is None:
                    _refused_peers.log("rejecting %s: wrong cluster token", self.peer)
                    self._refuse(message)
                    return
                if not self._has_room():
                    return
                self._write_now(encode_frame(AuthOk(auth.server_proof(key, challenge, message.nonce)), 0))
                self._seal_frames(auth.frame_seals(key, challenge.nonce, message.nonce, is_server=True))
                self.proven_key = key
            self._authenticated()
            return
        try:
            if isinstance(message, AuthChallenge):
                self._handshake = auth.ClientHandshake(self._key, self.peer)
                response = self._handshake.answer(message)
                # Dialled only where the server bound it itself (transports/same_host.py), and
                # only once the server's proof, which covers both fields, holds (connect).
                self.local_name = message.local_name if same_host.is_this_host(message.local_host) else ""
                self._write_now(encode_frame(response, 0))
                return
            if isinstance(message, AuthOk) and self._handshake is not None:
                self._seal_frames(self._handshake.check(message))
                self._authenticated()
                return
            if isinstance(message, ErrorReply) and self._handshake is not None:
                raise self._handshake.refused(message)
        except (Unauthorized, ConnectFailed) as exc:
            self._fail_handshake(exc)
            return
        raise RemoteProtocolError(f"unexpected {type(message).__name__} during the handshake")

    def _refuse(self, response: AuthResponse) -> None:
        """Say why before closing (the client raises Unauthorized, not a network error it would
        retry); close() would abort, dropping the frame unsent."""
        refusal = auth.refusal(response)
        self._write_now(encode_frame(refusal, 0, is_reply=True))
        if self._transport is not None:
            self._transport.close()
        self._finish(refusal.message)

    def _seal_frames(self, seals: tuple[FrameSeal, FrameSeal] | None) -> None:
        """From now on, tag every frame sent and check every frame received (a handshake with
        a token: protocol/auth.py). Every frame is tagged as it is written (`_header` is
        followed by `_write_frame`, which keeps their order), so the tags follow the order the
        peer receives them in."""
        if seals is not None:
            self._seal, incoming = seals
            self._decoder.expect_seal(incoming)

    def _begin_handshake(self) -> None:
        """A peer that does not finish the handshake in time is cut off (slow loris), and so is
        the oldest of a server's handshakes when HANDSHAKES_PENDING_MAX are under way: a flood of
        connections that never authenticate holds at most that many buffers (each up to
        HANDSHAKE_CONTROL_SIZE_BYTES_MAX), where it held every connection of the last
        AUTH_TIMEOUT_MS (helper-53: 220-500 MB). A kvpool peer's handshake takes one round trip,
        so it is the stalled ones that go, and a new connection always gets its turn."""
        self._handshake_timer = self._loop.call_later(limits.AUTH_TIMEOUT_MS / 1000, self._handshake_deadline)
        handshaking = self._handshaking
        if handshaking is None:
            return
        handshaking[self] = None
        if len(handshaking) > limits.HANDSHAKES_PENDING_MAX:
            oldest = next(iter(handshaking))
            _refused_peers.log(
                "closing %s: %d handshakes under way, it is the oldest (a flood of connections?)",
                oldest.peer, len(handshaking) - 1,
            )  # fmt: skip
            oldest.close("handshake pre-empted by newer connections")

    def _cancel_handshake_timer(self) -> None:
        """Let go of the handshake's timer once it is moot: it held a closed connection and its
        buffers for the rest of AUTH_TIMEOUT_MS (helper-53: ~19 KiB each, 76 MiB of a master's
        RSS under 500 connections a second)."""
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
            if self._handshaking is not None:
                self._handshaking.pop(self, None)

    def _handshake_deadline(self) -> None:
        if not self._ready.done() and not self.is_closed():
            _refused_peers.log("closing %s: no handshake within %d ms", self.peer, limits.AUTH_TIMEOUT_MS)
            self.close("handshake timed out")

    def _fail_handshake(self, exc: KVPoolError) -> None:
        if not self._ready.done():
            self._ready.set_exception(exc)
            self._ready.exception()
        self.close(str(exc))


def _warn_near_open_files_limit(connections: int) -> None:
    """Says (at most every 10 s) when this process holds OPEN_FILES_WARN_RATIO of its open-files
    limit, `connections` of them a server's connections: a client that leaks connections, or
    a limit too low for the cluster. Counted only from half the limit in connections on (a
    listing of /proc/self/fd), so that a server far from it pays one getrlimit per accept."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY or connections < limit // 2:
        return
    try:
        open_files = len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            return  # no /proc: nothing to tell
        open_files = limit  # the listing itself found none left
    if open_files >= limits.OPEN_FILES_WARN_RATIO * limit:
        _near_open_files_limit.log(
            "%d files open of this process's limit of %d, %d of them connections: past the limit, new "
            "connections are closed as they come, and their clients see only \"connection closed by "
            "peer\"; raise the limit (systemd's LimitNOFILE=, ulimit -n) or find the client that does "
            "not close its connections",
            open_files, limit, connections,
        )  # fmt: skip


def authenticated_connections_max() -> int:
    """How many authenticated connections a server holds at most: CONNECTIONS_SHARE_OF_OPEN_FILES
    of this process's open files limit, less the room of HANDSHAKES_PENDING_MAX handshakes (a
    quarter of the limit at least). Read at each handshake: servers raise the limit once started."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(limit // 4, int(limit * CONNECTIONS_SHARE_OF_OPEN_FILES) - limits.HANDSHAKES_PENDING_MAX)


def _payload_size(payload: Payload) -> int:
    return sum(part.size if type(part) is FileRange else len(part) for part in payload)  # type: ignore[union-attr]



def hand_late_reply(reply: Message, late_reply: LateReply) -> None:
    """Give a late reply to its caller's `late_reply`, unless it is an error (nothing granted)."""
    if not isinstance(reply, ErrorReply):
        late_reply(reply)


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("request handler failed", exc_info=task.exception())


def refuse_open_listen(host: str, key: bytes | None, serving: str = "") -> None:
    """Without a cluster token a server listens on loopback only: its RPC, and its /metrics,
    /health and /status too (they name every node's endpoint and host).

    Raises:
        Unauthorized: `host` is not loopback and `key` is None.
    """
    if key is None and not is_loopback(host):
        raise Unauthorized(
            f"refusing to listen on {host}{serving} without a cluster token: set KVPOOL_TOKEN or "
            "--token-file, or bind 127.0.0.1"
        )


def is_loopback(host: str) -> bool:
    """Whether `host` is "localhost" or a loopback address (127.0.0.0/8, ::1). A name that
    only starts with "127." (127.example.com) may resolve to any address: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Listener:
    """A server's listening sockets (TCP, and its same-host Unix socket) and the connections
    they accepted, so that stopping a server ends every conversation it had (an idle client
    must not keep talking to a stopped server)."""

    def __init__(
        self, servers: list[asyncio.Server], connections: set[Connection], busy_poll: BusyPoll | None = None
    ) -> None:
        self._servers = servers
        self.connections = connections
        self.busy_poll = busy_poll

    @property
    def port(self) -> int:
        return self._servers[0].sockets[0].getsockname()[1]

    def close_unaccepted(self, keyring: auth.Keyring) -> int:
        """Close the connections whose peer proved a key `keyring` no longer holds (a token
        rotated out: whoever held it is cut off, not only refused new connections). Returns
        how many."""
        unaccepted = [c for c in self.connections if c.proven_key is not None and c.proven_key not in keyring.keys]
        for conn in unaccepted:
            conn.close("its cluster token is no longer accepted")
        return len(unaccepted)

    async def close(self, timeout_ms: int = limits.CONNECT_TIMEOUT_MS_DEFAULT) -> None:
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close("server stopping")
        try:
            await asyncio.wait_for(
                asyncio.gather(*(server.wait_closed() for server in self._servers)), timeout_ms / 1000
            )
        except asyncio.TimeoutError:
            log.warning("listener did not close within %d ms", timeout_ms)


async def start_server(
    host: str,
    port: int,
    handler: RequestHandler,
    *,
    keyring: auth.Keyring,
    name: str,
    busy_poll_us: int = 0,
    not_back_soon: Callable[[Message, Message], bool] | None = None,
    replies_owed_max: int | None = None,
    flags: str = "",
) -> Listener:
    """Listen for kvpool connections on TCP and on a same-host Unix socket (see the module).
    `keyring`: the cluster keys it accepts (empty: no token, and only loopback may be bound;
    auth.Keyring: replaced in place, it serves new handshakes). `busy_poll_us`: how long the loop keeps
    polling after each reply (transports/busy_poll.py; 0: it sleeps in epoll at once), but
    after those that `not_back_soon(request, reply message)` picks out. `replies_owed_max`:
    how many replies a connection may owe (being prepared by an awaitable handler, or waiting
    behind a file-backed frame) before it reads no more of its peer's requests; None: only
    limits.HELD_FRAMES_MAX frames waiting behind a file-backed one stop it (a master's handler may
    wait seconds for room, and must not hold up the connection's other requests). `flags`:
    the settings `host` and `port` came from, named in the error when they cannot be bound.

    Raises:
        Unauthorized: a non-loopback host without a cluster token.
        ConnectFailed: the address cannot be bound.
    """
    refuse_open_listen(host, keyring.primary)
    loop = asyncio.get_running_loop()
    connections: set[Connection] = set()
    handshaking: dict[Connection, None] = {}
    heard: OrderedDict[Connection, None] = OrderedDict()
    busy_poll = BusyPoll(loop, busy_poll_us, not_back_soon) if busy_poll_us else None
    # Abstract namespace (leading NUL): no file to leave behind, gone with the process.
    local_name = f"\0kvpool-{os.urandom(16).hex()}"
    local_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def serving(announced_name: str = "") -> Connection:
        return Connection(
            handler, key=keyring, is_server=True, name=name, registry=connections, local_name=announced_name,
            busy_poll=busy_poll, replies_owed_max=replies_owed_max, handshaking=handshaking, heard=heard,
        )  # fmt: skip

    with map_exceptions({OSError: ConnectFailed}):
        try:
            local_socket.bind(local_name)
            local = await loop.create_unix_server(serving, sock=local_socket, backlog=1024)
        except BaseException:
            local_socket.close()
            raise
        servers: list[asyncio.Server] = []
        sockets: list[socket.socket] = []
        try:
            sockets = await bind_listening_sockets(host, port)
            for sock in sockets:
                servers.append(await loop.create_server(lambda: serving(local_name), sock=sock, backlog=1024))
        except BaseException as exc:
            for server in (*servers, local):
                server.close()
            for sock in sockets:
                sock.close()
            if not isinstance(exc, OSError):
                raise
            # Said as an operator reads it, not as "OSError: [Errno 98] ...".
            if isinstance(exc, socket.gaierror):  # a host name the resolver refuses: its errno is not errno's
                reason = exc.strerror or str(exc)
            else:
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
            named = f" ({flags})" if flags else ""
            raise ConnectFailed(f"{name} cannot listen on {host}:{port}{named}: {reason}") from None
    return Listener([*servers, local], connections, busy_poll)


async def bind_listening_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address of `host` ("": every interface), all on one port,
    for `loop.create_server(sock=...)` or aiohttp's SockSite. Given port 0, the first address
    picks it and the others take the same: asyncio's create_server gave each address a port of
    its own, and a server on `--host localhost` (127.0.0.1 and ::1) listened on two ports and
    reported one. Where another process holds the pick on a later address, it picks again, at
    most limits.LISTEN_PORT_PICKS_MAX times. Options as create_server's: SO_REUSEADDR, and
    IPV6_V6ONLY so that :: and 0.0.0.0 can both be bound.

    Raises:
        OSError: the host does not resolve (socket.gaierror), or an address cannot be bound.
    """
    # The system's resolver, as create_server's: uvloop's getaddrinfo takes "::1%lo", which the
    # system refuses, and drops its scope.
    resolve = functools.partial(socket.getaddrinfo, host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)  # fmt: skip
    infos = await asyncio.get_running_loop().run_in_executor(None, resolve)
    addresses = list(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in infos))  # in order, once
    for pick in range(limits.LISTEN_PORT_PICKS_MAX):
        sockets: list[socket.socket] = []
        try:
            bound_port = port
            for family, sockaddr in addresses:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((sockaddr[0], bound_port, *sockaddr[2:]))
                bound_port = sock.getsockname()[1]
            return sockets
        except OSError as exc:
            for sock in sockets:
                sock.close()
            is_pick_taken = port == 0 and len(sockets) > 1 and exc.errno == errno.EADDRINUSE
            if not is_pick_taken or pick == limits.LISTEN_PORT_PICKS_MAX - 1:
                raise
    raise AssertionError("unreachable: the last pick returns or raises")


async def connect(
    endpoint: str,
    *,
    key: bytes | None,
    handler: RequestHandler | None = None,
    timeout_ms: int = limits.CONNECT_TIMEOUT_MS_DEFAULT,
    name: str = "",
    prefer_local: bool = False,
) -> Connection:
    """Open and authenticate a connection to "host:port"; with `prefer_local`, on the server's
    Unix socket when it is on this host (see the module), else on TCP.

    Raises:
        ConnectFailed: refused, unreachable or timed out.
        Unauthorized: the token does not match, or the server's challenge was changed on the
            way (protocol/auth.py).
    """
    host, port = split_endpoint(endpoint)
    loop = asyncio.get_running_loop()

    def new_connection() -> Connection:
        return Connection(handler, key=key, is_server=False, name=name)

    conn = await _open(loop.create_connection(new_connection, host, port), endpoint, timeout_ms)
    if not prefer_local or not conn.local_name:
        return conn
    local_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        local_socket.setblocking(False)
        async with asyncio.timeout(timeout_ms / 1000):  # not wait_for: see wait_ready
            await loop.sock_connect(local_socket, conn.local_name)
        local = await _open(loop.create_unix_connection(new_connection, sock=local_socket), endpoint, timeout_ms)
    except BaseException as exc:
        # Whatever went wrong, the transport (if one was made) is closed and has let go of
        # the socket (asyncio closes it, uvloop detaches it), so closing it here is safe and
        # needed when the transport never got it. A cancelled caller gets neither connection.
        local_socket.close()
        if not isinstance(exc, (OSError, asyncio.TimeoutError, KVPoolError)):
            conn.close("cancelled while moving to the same-host socket")
            raise
        log.debug("%s: staying on TCP (%s)", endpoint, exc)  # Another host or namespace.
        return conn
    conn.close("moved to the same-host socket")
    local.peer = f"{endpoint} (same-host socket)"  # what errors name, rather than "local"
    return local


async def connect_with(keys: auth.Keyring, endpoint: str, **options: Any) -> Connection:
    """connect() with the process's current key, and with its others while a server refuses
    them as wrong tokens (auth.Keyring: a token rotated)."""
    for attempt in range(max(1, len(keys))):
        key = keys.primary
        try:
            return await connect(endpoint, key=key, **options)
        except Unauthorized as exc:
            if attempt == len(keys) - 1 or not keys.refused(key, exc):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _open(opening: Awaitable[tuple[object, object]], endpoint: str, timeout_ms: int) -> Connection:
    """The connection `opening` makes, once its handshake is done; closed if that fails."""
    try:
        async with asyncio.timeout(timeout_ms / 1000):  # not wait_for: see Connection.wait_ready
            with map_exceptions({OSError: ConnectFailed}):
                _, conn = await opening
    except TimeoutError:
        raise ConnectFailed(f"connect to {endpoint} timed out after {timeout_ms} ms") from None
    except ConnectFailed as exc:  # the address too: a Store(...) said only "Connection refused"
        raise ConnectFailed(f"connect to {endpoint}: {exc}") from exc.__cause__
    assert isinstance(conn, Connection)
    try:
        await conn.wait_ready(timeout_ms)
    except BaseException:
        conn.close("handshake not finished")
        raise
    return conn


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) from "host:port" (IPv6 in brackets). Raises InvalidParams."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise InvalidParams(f"not a host:port endpoint: {endpoint!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidParams(f"port out of range in {endpoint!r}")
    return host.strip("[]"), port

