"""Routing of requests to serving instances: round robin, random, or cache-aware.

A router picks the instance that serves a request. "cache-aware" picks the instance with the
longest local prefix (the leading blocks of the request held in that instance's own memory),
as a prefix-aware scheduler such as Mooncake's Conductor or SGLang's router would, breaking
ties (and the all-zero case) round robin. It models no load: a replay reports how many
requests each instance took, and a skew there is the price of cache-aware routing that this
simulation does not charge. Routers draw randomness only from the rng they are given.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvpool.errors import InvalidParams

ROUTINGS = ("round-robin", "random", "cache-aware")


class Router:
    """Picks an instance in [0, instance_count) for each request, in trace order.

    Args:
        routing: one of ROUTINGS.
        instance_count: instances to pick from.
        rng: the random router's only source of randomness.
    """

    def __init__(self, routing: str, instance_count: int, rng: random.Random) -> None:
        if routing not in ROUTINGS:
            raise InvalidParams(f"routing {routing!r} not one of {ROUTINGS}")
        if instance_count <= 0:
            raise InvalidParams(f"instance_count {instance_count} <= 0")
        self.routing = routing
        self.instance_count = instance_count
        self._rng = rng
        self._turn = 0

    @property
    def is_state_dependent(self) -> bool:
        """Whether a route depends on what the caches hold (else routes can be known ahead)."""
        return self.routing == "cache-aware"

    def route(self, local_prefix: Callable[[int], int]) -> int:
        """The instance for the next request; `local_prefix(i)` is instance i's local prefix
        in blocks (called only by the cache-aware router, once per instance)."""
        count = self.instance_count
        if self.routing == "random":
            return int(self._rng.random() * count)
        start = self._turn
        self._turn = (start + 1) % count
        if self.routing == "round-robin" or count == 1:
            return start
        best, best_prefix = start, -1
        for step in range(count):
            instance = (start + step) % count
            prefix = local_prefix(instance)
            if prefix > best_prefix:
                best, best_prefix = instance, prefix
        return best
