"""The server's ``GET /metrics`` over a ``bench serve`` run (``--sample-metrics``): a time series
of its memory and load, and how far its memory drifted.

A sample holds ``t`` (seconds since the run started) and each series below that the server
exports: flashserve's names, plus ``process_resident_memory_bytes`` (prometheus_client's
process collector, on Linux). The drift of a memory series is its last value minus its value
after warm-up (the first sample at or after ``WARM_UP`` of the run), so that loading the model
and filling the caches do not count. A scrape that fails is counted and its error kept, never
raised: the load test goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import httpx

SERIES = {  # key in a sample: the Prometheus sample it is read from
    "resident_memory_bytes": "process_resident_memory_bytes",
    "gpu_allocated_bytes": "flashserve_gpu_memory_allocated_bytes",
    "gpu_reserved_bytes": "flashserve_gpu_memory_reserved_bytes",
    "running": "flashserve_num_requests_running",
    "waiting": "flashserve_num_requests_waiting",
    "kv_cache_usage": "flashserve_kv_cache_usage_ratio",
}
MEMORY = ("resident_memory_bytes", "gpu_allocated_bytes", "gpu_reserved_bytes")
LOAD = ("running", "waiting", "kv_cache_usage")
WARM_UP = 0.1  # share of the run before the drift's reference sample
MIB = 2**20


class MetricsSampler:
    """Scrapes ``url``/metrics every ``period`` seconds between ``start()`` and ``stop()``,
    and once more at the stop, so that the last sample is taken after the run."""

    def __init__(self, url: str, period: float) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.period = period
        self.samples: list[dict[str, float]] = []
        self.failed = 0
        self.error: str | None = None  # the last failed scrape's
        # Apart from the load's connections, and a new connection per scrape: a kept-alive one
        # idle for about the period races the server closing it (uvicorn: after 5 s idle).
        self._client = httpx.AsyncClient(
            timeout=10.0, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self, t0: float) -> None:
        """Sample from now on; times are seconds since ``t0`` (``time.perf_counter()``)."""
        self._t0 = t0
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._scrape()
        await self._client.aclose()

    async def _loop(self) -> None:
        next_at = self._t0
        while True:
            await self._scrape()
            next_at = max(next_at + self.period, time.perf_counter())  # skip missed ticks
            await asyncio.sleep(next_at - time.perf_counter())

    async def _scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        t = time.perf_counter() - self._t0
        try:
            resp = await self._client.get(self.url)
            resp.raise_for_status()
            values = {s.name: s.value for f in text_string_to_metric_families(resp.text)
                      for s in f.samples if not s.labels}  # fmt: skip
        except (httpx.HTTPError, ValueError) as exc:
            self.failed += 1
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        sample = {key: values[name] for key, name in SERIES.items() if name in values}
        self.samples.append({"t": t, **sample})

    def result(self, duration_s: float) -> dict[str, Any]:
        """The series with, per memory series, first / warm / last / max and the drift, and
        per load series its mean and max; series the server does not export are left out."""
        series = lambda key: [(s["t"], s[key]) for s in self.samples if key in s]
        warm_t = WARM_UP * duration_s
        return {
            "url": self.url,
            "period_s": self.period,
            "scrapes": len(self.samples) + self.failed,
            "failed_scrapes": self.failed,
            "error": self.error,
            "memory": {k: _memory_drift(p, warm_t) for k in MEMORY if (p := series(k))},
            "load": {k: _mean_max(p) for k in LOAD if (p := series(k))},
            "samples": self.samples,
        }


def _memory_drift(points: list[tuple[float, float]], warm_t: float) -> dict[str, float]:
    """first, warm (the first value at or after ``warm_t``), last and max of ``(t, bytes)``
    points, and the drift last - warm in MiB and in percent of warm."""
    warm_at, warm = next(((t, v) for t, v in points if t >= warm_t), points[-1])
    last = points[-1][1]
    return {
        "first": points[0][1],
        "warm": warm,
        "warm_t": warm_at,
        "last": last,
        "max": max(v for _, v in points),
        "drift_mib": (last - warm) / MIB,
        "drift_percent": 100 * (last - warm) / warm if warm else math.nan,
    }


def _mean_max(points: list[tuple[float, float]]) -> dict[str, float]:
    values = [v for _, v in points]
    return {"mean": sum(values) / len(values), "max": max(values)}
