"""Whether a server's same-host Unix socket, announced in its first frame on TCP, is the
server's own (transports/connection.py).

An abstract Unix socket has no owner and no permissions: anyone on a host can bind a name in
its network namespace. Announced by a server on another host (or in another namespace), the
name a client dialled on its own host could be anyone's, and a local user without the cluster
token could bind it, relay the real server's handshake, and keep the authenticated connection
(a security review, 2026-12-07). So a client moves to the socket only when the server says it
runs on the same kernel and in the same network namespace, where the server bound that name
itself and nobody else can while it runs (and a name learnt from a server that has died since
leads to no server to relay to). The processes' pid namespaces do not matter: a master in a
container with the host's network (docker --network host) and a client outside it still move.
What the server says of its socket and host is covered by its proof of the cluster token
(protocol/auth.py server_proof), which the client checks before it takes the socket: a relay
cannot name one of its own, nor make another host's server look like this host's.
"""

from __future__ import annotations

import functools
import os


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
