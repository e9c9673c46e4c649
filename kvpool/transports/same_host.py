"""Whether a server's same-host Unix socket, announced in its first frame on TCP, is the
server's own (transports/connection.py).

An abstract Unix socket has no owner and no permissions: anyone on a host can bind a name in
its network namespace. Announced by a server on another host (or in another namespace), the
name a client dialled on its own host could be anyone's, and a local user without the cluster
token could bind it, relay the real server's handshake, and keep the authenticated connection
(a security review, 2026-12-07). So a client moves to the socket only when the server says it
runs on the same kernel and in the same network namespace, where the server bound that name
itself and nobody else can while it runs; and once connected, only when the peer's process
(SO_PEERCRED) is the server's.
"""

from __future__ import annotations

import functools
import os
import socket
import struct

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@functools.cache
def host_identity() -> str:
    """This kernel's boot id and this process's network namespace, or "" where either cannot
    be read (then no peer takes this host for its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:  # noqa: PTH123
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot_id}/{namespace}" if boot_id else ""


def is_this_host(identity: str) -> bool:
    """Whether a server that announced `identity` runs on this kernel, in this network namespace."""
    return bool(identity) and identity == host_identity()


def is_served_by(sock: socket.socket, pid: int) -> bool:
    """Whether the process at the other end of the connected Unix socket `sock` is `pid` (as
    this process's pid namespace sees it: a server in another one is not taken for its own)."""
    try:
        peer_pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return False
    return pid > 0 and peer_pid == pid
