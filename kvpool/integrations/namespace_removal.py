"""The removal of an engine's namespace from the pool (vLLM's reset of the connector's cache,
SGLang's clear of its storage backend), which the engine waits for on its scheduler or engine
loop, serving nothing meanwhile: waited for only while the master answers.

A master removing millions of objects takes seconds, and answers other requests between its
steps; one that answers nothing (SIGSTOP, a partition) held the engine the removal's bound,
BULK_REMOVE_TIMEOUT_MS (300 s). Each removal runs on a thread of its own (they are rare): behind
one given up on, stuck on a connection that never answers while probes on another do, the next
would wait out those 300 s.
"""

from __future__ import annotations

import concurrent.futures

from kvpool import limits
from kvpool.client.sync import Store


class NamespaceRemovals:
    """The removals of one adapter's store, and their threads."""

    def __init__(self, store: Store, probe_timeout_ms: int, thread_name: str) -> None:
        self._store = store
        self._probe_timeout_ms = probe_timeout_ms
        self._thread_name = thread_name
        self._running: list[tuple[concurrent.futures.ThreadPoolExecutor, concurrent.futures.Future[int]]] = []

    def remove(self, pattern: str) -> int:
        """How many objects whose key matches `pattern` (remove_by_regex, forced) were removed,
        waited for as long as the master answers: between waits of the probe timeout, a probe
        of that bound (cluster_status) must be answered. A removal given up on goes on, on its
        thread, until the master answers it, its bound ends or close(); a later one runs beside
        it (removing more is harmless).

        Raises:
            KVPoolError: the removal's, or the probe's (the master did not answer it).
        """
        for running in [running for running in self._running if running[1].done()]:
            running[0].shutdown(wait=False)
            self._running.remove(running)
        remover = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        removal = remover.submit(
            self._store.remove_by_regex, pattern, force=True, timeout_ms=limits.BULK_REMOVE_TIMEOUT_MS
        )
        self._running.append((remover, removal))
        wait_s = self._probe_timeout_ms / 1000
        while True:
            try:
                return removal.result(timeout=wait_s)
            except concurrent.futures.TimeoutError:
                self._store.cluster_status(timeout_ms=self._probe_timeout_ms)

    def close(self) -> None:
        """Let the removals still running go (they end with the store, closed after this)."""
        for remover, _ in self._running:
            remover.shutdown(wait=False, cancel_futures=True)
        self._running = []
