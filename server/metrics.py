"""Prometheus metrics at ``GET /metrics``, one registry per app (tests build several apps).

- ``flashserve_http_requests_total{route, status}``: every answered request (429s, 401s...);
- ``flashserve_prompt_tokens_total``, ``flashserve_generation_tokens_total``;
- histograms: ``flashserve_time_to_first_token_seconds``,
  ``flashserve_inter_token_latency_seconds``, ``flashserve_e2e_request_latency_seconds``
  (engine request: submitted to last token) and ``flashserve_request_queue_time_seconds``
  (the wait for an admission slot; time in the engine's own queue shows in the TTFT);
- ``flashserve_aborted_requests_total``: requests that ended before their end (client gone);
- the engine's gauges, from the latest stats snapshot it published (``EngineClient.stats``;
  the engine core process sends one with every step, and every 0.5 s while idle):
  ``flashserve_num_requests_running``, ``flashserve_num_requests_waiting``,
  ``flashserve_kv_cache_usage_ratio`` and ``flashserve_num_preemptions_total``;
- the prefix cache, in tokens, since start (as vLLM's ``prefix_cache_queries``/``hits``):
  ``flashserve_prefix_cache_queries_total`` (prompt tokens that admissions looked up),
  ``flashserve_prefix_cache_hits_total`` (those found cached, not computed), and
  ``flashserve_prefix_cache_hit_rate``, hits / queries since start (a dashboard's recent rate
  is ``rate(hits) / rate(queries)``). With no query yet (or caching off) the hit rate is left
  out: 0 of 0 is no rate;
- memory, for soak runs: ``process_resident_memory_bytes`` and the other ``process_*`` series
  of prometheus_client's process collector (Linux only: it reads /proc), and when the engine
  runs on CUDA ``flashserve_gpu_memory_allocated_bytes`` and
  ``flashserve_gpu_memory_reserved_bytes`` (torch's caching allocator on the engine's device).
  On a CPU the GPU gauges are left out, not 0: a missing series is not a measured zero.

Each OpenAI choice (``n``) is an engine request of its own and counts as one here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashserve.engine.protocol import EngineClient, RequestStats

router = APIRouter()
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The app's registry and its instruments; ``observe`` is an ``EngineClient.on_finished``."""

    def __init__(self, app: FastAPI) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flashserve_http_requests", "HTTP requests answered, by route "
                                "and status", ["route", "status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("flashserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "flashserve_generation_tokens", "generated tokens", registry=r
        )
        self.aborted = Counter("flashserve_aborted_requests", "requests aborted before their "
                               "end", registry=r)  # fmt: skip
        self.ttft = Histogram("flashserve_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)  # fmt: skip
        self.itl = Histogram("flashserve_inter_token_latency_seconds", "time between tokens",
                             buckets=_TOKEN_LATENCY, registry=r)  # fmt: skip
        self.e2e = Histogram("flashserve_e2e_request_latency_seconds", "request latency",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.queue_time = Histogram("flashserve_request_queue_time_seconds", "wait for an "
                                    "admission slot", buckets=_LATENCY, registry=r)  # fmt: skip
        ProcessCollector(registry=r)
        r.register(_EngineCollector(app))

    def observe(self, stats: RequestStats) -> None:
        """One finished engine request (called on the event loop, never the engine thread)."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generated_tokens)
        if stats.aborted:
            self.aborted.inc()
        if stats.first_token is not None:
            self.ttft.observe(stats.first_token - stats.arrival)
        for gap in stats.token_gaps:
            self.itl.observe(gap)
        if stats.finished is not None:
            self.e2e.observe(stats.finished - stats.arrival)


class _EngineCollector:
    """The engine's gauges at scrape time, from its latest stats snapshot."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        llm: EngineClient | None = getattr(self.app.state, "llm", None)
        stats = llm.stats() if llm is not None else None
        if stats is None:
            return
        yield GaugeMetricFamily("flashserve_num_requests_running", "sequences running",
                                value=stats.running)  # fmt: skip
        yield GaugeMetricFamily("flashserve_num_requests_waiting", "sequences waiting",
                                value=stats.waiting)  # fmt: skip
        yield GaugeMetricFamily("flashserve_kv_cache_usage_ratio", "share of KV blocks in use",
                                value=stats.kv_usage)  # fmt: skip
        yield CounterMetricFamily("flashserve_num_preemptions", "sequences preempted",
                                  value=stats.preemptions)  # fmt: skip
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        yield CounterMetricFamily("flashserve_prefix_cache_queries", "prompt tokens looked up "
                                  "in the prefix cache", value=queries)  # fmt: skip
        yield CounterMetricFamily("flashserve_prefix_cache_hits", "prompt tokens found in the "
                                  "prefix cache", value=hits)  # fmt: skip
        if queries:
            yield GaugeMetricFamily("flashserve_prefix_cache_hit_rate", "prefix cache hits / "
                                    "queries since start", value=hits / queries)  # fmt: skip
        if stats.gpu_memory is not None:
            allocated, reserved = stats.gpu_memory
            yield GaugeMetricFamily(
                "flashserve_gpu_memory_allocated_bytes", "GPU memory in tensors", value=allocated
            )
            yield GaugeMetricFamily(
                "flashserve_gpu_memory_reserved_bytes", "GPU memory held by torch", value=reserved
            )


class RequestCounter:
    """ASGI middleware: counts every answer by route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, fastapi_app: FastAPI) -> None:
        self.app = app
        self.metrics = metrics
        self.fastapi_app = fastapi_app
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.requests.labels(self._route(scope["path"]), str(status)).inc()

    def _route(self, path: str) -> str:
        """The route's template (``/v1/models/{model_id}``); "other" for unknown paths, which
        would otherwise let clients make up labels."""
        if self._templates is None:  # the app's routes, from its (cached) OpenAPI schema
            paths = self.fastapi_app.openapi().get("paths", {})
            self._templates = [(_template_regex(t), t) for t in paths]
        for regex, template in self._templates:
            if regex.fullmatch(path):
                return template
        return "other"


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", template)
    return re.compile("".join(".+" if p.startswith("{") else re.escape(p) for p in parts))


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus' text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    body = generate_latest(request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def add_metrics(app: FastAPI) -> Metrics:
    """A registry for ``app``, its request counter middleware and the /metrics route."""
    m = Metrics(app)
    app.state.metrics = m
    app.include_router(router)
    app.add_middleware(RequestCounter, metrics=m, fastapi_app=app)
    return m
