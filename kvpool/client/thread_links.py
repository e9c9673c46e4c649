"""Connections of a sync Store's caller threads, each thread its own.

A sync Store's caller thread may keep blocking connections of its own (transports/blocking.py),
so that its requests go without waking the Store's loop thread: to the master (client/sync.py)
and to the nodes it transfers with (client/node_links.py), each kind with a ThreadLinks of its
own. Of each, at most `threads_max` threads of a Store hold connections: a serving process may
run large thread pools, and a server's connections must stay bounded. The others go through the
loop, and ask for a place again after `retry_after_s`.
A thread's connections live in a threading.local: they go, and their sockets close, when the
thread ends, and the Store closes those still open when it closes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar


class ThreadLink:
    """One caller thread's connections (a subclass says which, and how to close them)."""

    __slots__ = ("is_admitted", "admit_at", "__weakref__")

    def __init__(self) -> None:
        self.is_admitted = False  # one of the Store's threads_max places is this thread's
        self.admit_at = 0.0  # when no place was free: ask again from then

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


L = TypeVar("L", bound=ThreadLink)


class ThreadLinks(Generic[L]):
    """The links of a Store's caller threads (see the module)."""

    def __init__(self, make_link: Callable[[], L], threads_max: int, retry_after_s: float) -> None:
        self._make_link = make_link
        self._threads_max = threads_max
        self._retry_after_s = retry_after_s
        self._local = threading.local()
        self._links: weakref.WeakSet[L] = weakref.WeakSet()  # the admitted, closed with the Store
        self._lock = threading.Lock()
        self.is_closed = False

    def link(self) -> L:
        """This thread's link; its `is_admitted` says whether it may hold connections."""
        link: L | None = getattr(self._local, "link", None)
        if link is None:
            link = self._local.link = self._make_link()
        if not link.is_admitted and time.monotonic() >= link.admit_at:
            with self._lock:
                if len(self._links) < self._threads_max:
                    self._links.add(link)
                    link.is_admitted = True
                else:
                    link.admit_at = time.monotonic() + self._retry_after_s
        return link

    def admitted(self) -> list[L]:
        """The links of live admitted threads."""
        with self._lock:
            return list(self._links)

    def close(self) -> None:
        """Close every admitted thread's connections; a link opened after this closes its own
        (its owner checks `is_closed` once it has it)."""
        self.is_closed = True
        for link in self.admitted():
            link.close()


__all__ = ["ThreadLink", "ThreadLinks"]
