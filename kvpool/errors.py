"""The one exception tree of kvpool, and the integer codes that go with it.

This module is the whole error model (STYLE.md "Error model"): every operating error is a
subclass of `KVPoolError` carrying `code: ClassVar[ErrorCode]`, whose values equal Mooncake's
`ErrorCode` in `mooncake-store/include/types.h`, so that the Mooncake-compatible edge can turn
exceptions into ints without a table of its own. It is not where errors are handled: pure cores
return `None` for expected outcomes, services raise these, batch APIs return one code per key.

    KVPoolError
      ObjectError        ObjectNotFound(-704) ObjectAlreadyExists(-705) ObjectHasLease(-706)
                         LeaseExpired(-707) ReplicaNotReady(-703) ChecksumMismatch(-800)
      CapacityError      NoAvailableHandle(-200)  FilesystemFull(-200)  BufferOverflow(-10)
      InvalidRequest     InvalidKey(-400)  InvalidParams(-600)  Unauthorized(-601)  StoreClosed(-600)
      MembershipError    SegmentNotFound(-101)  ClientNotFound(-103)  SegmentAlreadyExists(-102)
                         NotLeader(-1010)
      TransportError     TransferFailed(-800)  RpcFailed(-900)  RpcTimeout(-901)  ConnectFailed(-900)
                         CoordinationError(-1000)
      ProtocolError      LocalProtocolError  RemoteProtocolError   (h11's split by who is at fault)
      InternalError(-1)
"""

from __future__ import annotations

import contextlib
import enum
import errno
from collections.abc import Iterator
from typing import ClassVar


class ErrorCode(enum.IntEnum):
    """Mooncake's status codes (types.h), plus OK. Only the ones kvpool can produce."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010


class KVPoolError(Exception):
    """Root of every operating error kvpool raises."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL_ERROR


class ObjectError(KVPoolError):
    code = ErrorCode.OBJECT_NOT_FOUND


class ObjectNotFound(ObjectError):
    code = ErrorCode.OBJECT_NOT_FOUND


class ObjectAlreadyExists(ObjectError):
    code = ErrorCode.OBJECT_ALREADY_EXISTS


class ObjectHasLease(ObjectError):
    code = ErrorCode.OBJECT_HAS_LEASE


class LeaseExpired(ObjectError):
    code = ErrorCode.LEASE_EXPIRED


class ReplicaNotReady(ObjectError):
    code = ErrorCode.REPLICA_IS_NOT_READY


class ChecksumMismatch(ObjectError):
    """The bytes read do not hash to the checksum recorded at put: never returned to a caller."""

    code = ErrorCode.TRANSFER_FAIL


class CapacityError(KVPoolError):
    code = ErrorCode.NO_AVAILABLE_HANDLE


class NoAvailableHandle(CapacityError):
    """No segment has room for the object, even after eviction."""

    code = ErrorCode.NO_AVAILABLE_HANDLE


class FilesystemFull(CapacityError):
    """A disk tier's or the DFS's filesystem has no space left (ENOSPC, EDQUOT), though the
    tier's capacity had room: other files, or a quota, took it."""

    code = ErrorCode.NO_AVAILABLE_HANDLE


class BufferOverflow(CapacityError):
    """The caller's buffer is smaller than the object."""

    code = ErrorCode.BUFFER_OVERFLOW


class InvalidRequest(KVPoolError):
    code = ErrorCode.INVALID_PARAMS


class InvalidKey(InvalidRequest):
    code = ErrorCode.INVALID_KEY


class InvalidParams(InvalidRequest):
    code = ErrorCode.INVALID_PARAMS


class StoreClosed(InvalidRequest):
    """A call on a Store or AsyncStore after its close(): it opens no connection again."""

    code = ErrorCode.INVALID_PARAMS


class Unauthorized(InvalidRequest):
    """Wrong cluster token, or a write outside a granted range."""

    code = ErrorCode.ILLEGAL_CLIENT


class MembershipError(KVPoolError):
    code = ErrorCode.SEGMENT_NOT_FOUND


class SegmentNotFound(MembershipError):
    code = ErrorCode.SEGMENT_NOT_FOUND


class SegmentAlreadyExists(MembershipError):
    code = ErrorCode.SEGMENT_ALREADY_EXISTS


class ClientNotFound(MembershipError):
    code = ErrorCode.CLIENT_NOT_FOUND


class TransportError(KVPoolError):
    code = ErrorCode.TRANSFER_FAIL


class TransferFailed(TransportError):
    code = ErrorCode.TRANSFER_FAIL


class RpcFailed(TransportError):
    code = ErrorCode.RPC_FAIL


class RpcTimeout(TransportError):
    code = ErrorCode.RPC_TIMEOUT


class ConnectFailed(TransportError):
    code = ErrorCode.RPC_FAIL


class ProtocolError(KVPoolError):
    code = ErrorCode.RPC_FAIL


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids: a bug on our side."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids: the connection is closed."""


class InternalError(KVPoolError):
    code = ErrorCode.INTERNAL_ERROR


# The class raised for a code that arrives on the wire. Where several classes share a code the
# most general useful one wins (a remote TRANSFER_FAIL is a TransferFailed, not a checksum error).
_CLASS_BY_CODE: dict[int, type[KVPoolError]] = {
    ErrorCode.INTERNAL_ERROR: InternalError,
    ErrorCode.BUFFER_OVERFLOW: BufferOverflow,
    ErrorCode.SEGMENT_NOT_FOUND: SegmentNotFound,
    ErrorCode.SEGMENT_ALREADY_EXISTS: SegmentAlreadyExists,
    ErrorCode.CLIENT_NOT_FOUND: ClientNotFound,
    ErrorCode.NO_AVAILABLE_HANDLE: NoAvailableHandle,
    ErrorCode.INVALID_KEY: InvalidKey,
    ErrorCode.INVALID_PARAMS: InvalidParams,
    ErrorCode.ILLEGAL_CLIENT: Unauthorized,
    ErrorCode.REPLICA_IS_NOT_READY: ReplicaNotReady,
    ErrorCode.OBJECT_NOT_FOUND: ObjectNotFound,
    ErrorCode.OBJECT_ALREADY_EXISTS: ObjectAlreadyExists,
    ErrorCode.OBJECT_HAS_LEASE: ObjectHasLease,
    ErrorCode.LEASE_EXPIRED: LeaseExpired,
    ErrorCode.TRANSFER_FAIL: TransferFailed,
    ErrorCode.RPC_FAIL: RpcFailed,
    ErrorCode.RPC_TIMEOUT: RpcTimeout,
}


def error_from_code(code: int, message: str = "") -> KVPoolError:
    """The exception to raise for a non-zero `code` received from a peer."""
    assert code != ErrorCode.OK, "error_from_code called with OK"
    cls = _CLASS_BY_CODE.get(code, InternalError)
    return cls(message or f"error code {code}")


def code_of(exc: BaseException) -> ErrorCode:
    """The wire code for an exception: its class code, INTERNAL_ERROR for anything foreign."""
    if isinstance(exc, KVPoolError):
        return exc.code
    return ErrorCode.INTERNAL_ERROR


@contextlib.contextmanager
def map_exceptions(mapping: dict[type[BaseException], type[KVPoolError]]) -> Iterator[None]:
    """Translate foreign exceptions at a boundary, keeping the cause (httpcore's idiom).

    The first matching entry in `mapping` wins, so list subclasses before their bases.
    """
    try:
        yield
    except Exception as exc:
        for from_exc, to_exc in mapping.items():
            if isinstance(exc, from_exc):
                raise to_exc(_said(exc)) from exc
        raise


def _said(exc: Exception) -> str:
    """A foreign exception as an operator reads it: an OSError by its reason, errno name and
    file ("Connection refused (ECONNREFUSED)", not "ConnectionRefusedError: [Errno 111]
    Connection refused"); anything else by its type and message."""
    if isinstance(exc, OSError) and exc.strerror:
        name = errno.errorcode.get(exc.errno or 0)
        said = f"{exc.strerror} ({name})" if name else exc.strerror
        return said if exc.filename is None else f"{said}: {exc.filename}"
    return f"{type(exc).__name__}: {exc}"


# --- high availability (appended with kvpool/master/election.py) -----------------------------


class NotLeader(MembershipError):
    """This master does not take the request now, and did nothing with it: it is a standby, a
    leader that stepped down (its etcd lease may have lapsed), or a new leader still waiting
    for the nodes to re-mount before it takes puts. Ask the leader (again): a client or node
    given `etcd://...` re-resolves and retries by itself within its call's bound.
    Mooncake's UNAVAILABLE_IN_CURRENT_STATUS (types.h)."""

    code = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS


class CoordinationError(TransportError):
    """etcd answered, but with an error (or with something that is not etcd's v3 JSON API).
    An unreachable etcd is a ConnectFailed or an RpcTimeout instead. Mooncake's
    ETCD_OPERATION_ERROR (types.h)."""

    code = ErrorCode.ETCD_OPERATION_ERROR


_CLASS_BY_CODE[ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] = NotLeader
_CLASS_BY_CODE[ErrorCode.ETCD_OPERATION_ERROR] = CoordinationError
