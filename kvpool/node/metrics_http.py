"""A node's HTTP surface: GET /metrics (Prometheus text), GET /health and GET /ready (JSON).

Apart from node/metrics.py because it brings aiohttp, a seventh of a second of every start: a
node imports it only when a metrics port is configured (not in tests' clusters, nor in a node
embedded in a client).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.node.metrics import NodeMetrics
from kvpool.transports.http import serve_http


class MetricsServer:
    """aiohttp server for GET /metrics (Prometheus text), GET /health and GET /ready (JSON)."""

    def __init__(self, metrics: NodeMetrics, health: Callable[[], dict[str, Any]]) -> None:
        self._metrics = metrics
        self._health = health
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (0: ephemeral); `endpoint` is then the bound "host:port"."""
        app = web.Application()
        app.router.add_get("/metrics", self._get_metrics)
        app.router.add_get("/health", self._get_health)
        app.router.add_get("/ready", self._get_ready)
        runner, bound_port = await serve_http(app, host, port, "--metrics-port")
        self._runner = runner
        self.endpoint = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _get_metrics(self, request: web.Request) -> web.Response:
        body = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _get_health(self, request: web.Request) -> web.Response:
        """200 while the process answers: a liveness probe's. Its `status` says whether the node
        serves the cluster; a probe that restarted a node its master refused (a forged refusal
        too) would lose every object the node held: a restarted node refused exits."""
        return web.Response(text=json.dumps(self._health()), content_type="application/json")

    async def _get_ready(self, request: web.Request) -> web.Response:
        """The same JSON; 200 while the node serves the cluster (`status` "ok"), else 503
        (starting, stopping, no master holds its segment, refused by its master over the
        cluster token): a readiness probe's or an alert's, never a reason to restart the node."""
        health = self._health()
        status = 200 if health["status"] == "ok" else 503
        return web.Response(text=json.dumps(health), status=status, content_type="application/json")
