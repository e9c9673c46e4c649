"""Cluster-token cryptography: the connection handshake MACs and the signed write grants.

Pure functions over bytes, no sockets and no clocks (callers pass `now_ms`). The cluster key is
derived once from the operator's token; every MAC is HMAC-SHA256 with a purpose label, so a MAC
made for one purpose can never be replayed as another.

Handshake (only when the server has a token):

    server -> client  AuthChallenge(nonce_s, required=True, local_name, local_host)
    client -> server  AuthResponse(nonce_c, mac=client_proof(key, nonce_s, nonce_c))
                      (mac empty from a client without a token)
    server -> client  AuthOk(mac=server_proof(key, challenge, nonce_c))
                      or ErrorReply(ILLEGAL_CLIENT, "wrong cluster token" or "... requires a
                      cluster token"), then it closes

The refusal tells the client it holds the wrong token, or none (Unauthorized, which no caller
retries); it tells nothing about the right one. A client from before the refusal existed took
it for a protocol error and closed, as it did when the server just closed. A client without a
token answers too (before wire version 10 it closed at the challenge), so that the server can
log who came without one.

The server's proof covers every field of its challenge, not only the nonce: the challenge
comes before anything is proven, and a relay that changed `local_name` and `local_host` could
send a same-host client to a Unix socket of the relay's choosing (transports/same_host.py), or
one that changed `required` could make either end give up. The client checks the proof
against the challenge it received, so a changed field fails the handshake (before wire version
10 the proof covered the nonces only).

Every frame after AuthOk is sealed (protocol/frames.py FrameSeal) with a key per direction
derived from the cluster key and both nonces (`frame_seals`): the handshake proves who is at
each end, and the tags prove that each later frame came from that end, in that order. Without
them, whoever steered a token holder's connection through itself (a network path, DNS, a leader
record in etcd) could relay the handshake and then send frames of its own on the connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

from kvpool import limits
from kvpool.errors import ConnectFailed, ErrorCode, InvalidParams, KVPoolError, Unauthorized, error_from_code
from kvpool.protocol.frames import FrameSeal
from kvpool.protocol.messages import AuthChallenge, AuthOk, AuthResponse, ErrorReply, WriteGrant

_GRANT_MAC_SIZE_BYTES = 16


def cluster_key(token: str) -> bytes:
    """The 32-byte key every MAC uses, derived from the operator's token."""
    assert token, "an empty token means 'no token': pass None instead"
    return hashlib.sha256(b"kvpool-cluster-key\0" + token.encode()).digest()


def cluster_mark(key: bytes | None) -> str:
    """What shared state records of the cluster that uses it (the DFS tier's owner, the mark
    in etcd): derived from the cluster key, not the key; "none" for a cluster without a token
    ("" is a DFS directory written before owners were recorded)."""
    return hmac.digest(key, b"kvpool-cluster-mark", "sha256")[:16].hex() if key else "none"


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, b"client\0" + server_nonce + client_nonce, "sha256")


def server_proof(key: bytes, challenge: AuthChallenge, client_nonce: bytes) -> bytes:
    """The server's proof of the token, bound to every field of the challenge it sent."""
    name, host = challenge.local_name.encode(), challenge.local_host.encode()
    # Each name with its length: an abstract socket's name starts with a NUL, so no separator is safe.
    fields = b"%d %d:%b %d:%b" % (challenge.required, len(name), name, len(host), host)
    return hmac.digest(key, b"server\0" + challenge.nonce + client_nonce + fields, "sha256")


def is_valid_proof(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)


def frame_seals(
    key: bytes, server_nonce: bytes, client_nonce: bytes, *, is_server: bool
) -> tuple[FrameSeal, FrameSeal]:
    """This end's (outgoing, incoming) seals for the frames after the handshake: one key per
    direction and connection, from the cluster key and both nonces."""
    nonces = server_nonce + client_nonce
    to_server = FrameSeal(hmac.digest(key, b"frames to server\0" + nonces, "sha256"))
    to_client = FrameSeal(hmac.digest(key, b"frames to client\0" + nonces, "sha256"))
    return (to_client, to_server) if is_server else (to_server, to_client)


class ClientHandshake:
    """The client's side of the handshake, for either I/O shell (transports/connection.py and
    transports/blocking.py): answer the server's challenge, then check the server's proof,
    which covers the challenge as this client received it. A client with a token refuses a
    server without one; a client without one answers a server that requires one, which then
    refuses it, saying why (`refused`)."""

    __slots__ = ("_key", "_peer", "_challenge", "_client_nonce")

    def __init__(self, key: bytes | None, peer: str) -> None:
        self._key = key
        self._peer = peer
        self._challenge: AuthChallenge | None = None
        self._client_nonce = b""

    def answer(self, challenge: AuthChallenge) -> AuthResponse:
        """Raises Unauthorized: this client has a cluster token and the server has none."""
        if not challenge.required and self._key is not None:
            raise Unauthorized(f"{self._peer} has no cluster token; refusing to trust it")
        self._challenge = challenge
        self._client_nonce = os.urandom(limits.AUTH_NONCE_SIZE_BYTES)
        mac = b"" if self._key is None else client_proof(self._key, challenge.nonce, self._client_nonce)
        return AuthResponse(self._client_nonce, mac)

    def refused(self, reply: ErrorReply) -> KVPoolError:
        """The server's refusal of this client's proof, as the error to raise: Unauthorized;
        ConnectFailed for an error a server never answers a handshake with (a relay's, or a
        broken peer's: not worth a traceback, and a retry may find the real server)."""
        if reply.code != ErrorCode.ILLEGAL_CLIENT:
            return ConnectFailed(f"{self._peer} answered the handshake with error {reply.code}: {reply.message:.200}")
        if self._key is None:
            return Unauthorized(f"{self._peer} requires a cluster token")
        return error_from_code(reply.code, f"{self._peer} refused the connection: {reply.message}")

    def check(self, ok: AuthOk) -> tuple[FrameSeal, FrameSeal] | None:
        """The client's (outgoing, incoming) frame seals, None without a token.

        Raises:
            Unauthorized: the server did not prove it holds the token, or its challenge was
                changed on the way; or it took no token where it required one (a relay's
                AuthOk: no server sends it).
        """
        challenge = self._challenge
        assert challenge is not None, "check() before answer()"
        if self._key is None:
            if challenge.required:
                raise Unauthorized(f"{self._peer} requires a cluster token, yet took none")
            return None
        expected = server_proof(self._key, challenge, self._client_nonce)
        if not is_valid_proof(expected, ok.mac):
            raise Unauthorized(
                f"{self._peer} failed to prove the token, or its challenge (whether it requires one, "
                "its same-host socket) was changed on the way"
            )
        return frame_seals(self._key, challenge.nonce, self._client_nonce, is_server=False)


class Keyring:
    """The cluster keys a process holds, from its tokens, the first first. A server accepts
    every one from its peers and signs grants with the first; a client connects with the first
    until a server refuses it as a wrong token, then with the next. So a token is rotated in
    and out without a restart (docs/operations.md "Rotating the token"), and a Store opened
    between the rotation's first and last steps rides through the last on the new token.
    One per process (per Store for a client), shared by its servers or connections; `replace`
    swaps the set in place: new handshakes and grants see it at once, connections already
    authenticated keep the key they proved. Empty: no token."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        self.keys: tuple[bytes, ...] = tuple(dict.fromkeys(keys))

    @classmethod
    def of(cls, tokens: Sequence[str]) -> Keyring:
        return cls([cluster_key(token) for token in tokens])

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def primary(self) -> bytes | None:
        """The key this process signs and connects with; None without a token."""
        return self.keys[0] if self.keys else None

    def marks(self) -> list[str]:
        """cluster_mark of each key, the primary's first (["none"] without a token)."""
        return [cluster_mark(key) for key in self.keys] or [cluster_mark(None)]

    def first_mark(self) -> str:
        """What logs name the primary by: its mark's first 8 digits, which tell one token from
        another and nothing of it ("none" without a token)."""
        return self.marks()[0][:8]

    def replace(self, tokens: Sequence[str]) -> None:
        """Take `tokens` in place of the current ones.

        Raises:
            InvalidParams: none given to a process that has a token, or some to one that has
                none: which addresses a server may listen on depends on it (a restart).
        """
        if bool(tokens) != bool(self.keys):
            raise InvalidParams(
                "a process started with a cluster token keeps one" if self.keys
                else "a process started without a cluster token takes one only at a restart"
            )  # fmt: skip
        self.keys = Keyring.of(tokens).keys

    def refused(self, key: bytes | None, error: Unauthorized) -> bool:
        """A server refused this client's `key`: whether to connect again with `primary`,
        another key (the server said "wrong cluster token", and there is another). The refused
        key goes last: tried again only once the others were refused too."""
        if key is None or len(self.keys) < 2 or WRONG_TOKEN not in str(error):
            return False
        if self.keys[0] == key:
            self.keys = (*self.keys[1:], key)
        return True

    def proven_key(self, server_nonce: bytes, client_nonce: bytes, mac: bytes) -> bytes | None:
        """The key a client's proof was made with, or None for none of them."""
        for key in self.keys:
            if is_valid_proof(client_proof(key, server_nonce, client_nonce), mac):
                return key
        return None

    def is_valid_grant(self, grant: WriteGrant, now_ms: int) -> bool:
        """is_valid_grant under any of the keys (without a token: unexpired)."""
        if not self.keys:
            return is_valid_grant(None, grant, now_ms)
        return any(is_valid_grant(key, grant, now_ms) for key in self.keys)


WRONG_TOKEN = "wrong cluster token"  # what a server answers a proof made with another token


def refusal(response: AuthResponse) -> ErrorReply:
    """What a server with a token answers a client whose proof is wrong or missing, before it
    closes."""
    why = WRONG_TOKEN if response.mac else "this cluster requires a cluster token; none was sent"
    return ErrorReply(int(ErrorCode.ILLEGAL_CLIENT), why)


def _grant_body(segment_id: str, offset: int, size: int, expiry_ms: int, term: int) -> bytes:
    return f"grant\0{segment_id}\0{offset}\0{size}\0{expiry_ms}\0{term}".encode()


def sign_grant(
    key: bytes | None, segment_id: str, offset: int, size: int, expiry_ms: int, term: int = 0
) -> WriteGrant:
    """A write grant for a byte range, signed when the cluster has a key."""
    mac = b""
    if key is not None:
        body = _grant_body(segment_id, offset, size, expiry_ms, term)
        mac = hmac.digest(key, body, "sha256")[:_GRANT_MAC_SIZE_BYTES]
    return WriteGrant(segment_id, offset, size, expiry_ms, mac, term)


def is_valid_grant(key: bytes | None, grant: WriteGrant, now_ms: int) -> bool:
    """True when the grant is unexpired and, with a key, carries the master's signature."""
    if grant.expiry_ms < now_ms:
        return False
    if key is None:
        return True
    body = _grant_body(grant.segment_id, grant.offset, grant.size, grant.expiry_ms, grant.term)
    expected = hmac.digest(key, body, "sha256")[:_GRANT_MAC_SIZE_BYTES]
    return hmac.compare_digest(expected, grant.mac)
