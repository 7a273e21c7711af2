"""Production behaviour of the HTTP server on ``dummy:tiny``: admission control, health and
readiness, graceful shutdown on SIGTERM, the API key and CORS, Prometheus metrics.

Most tests run the server as a real process (``python -m server serve``); the queue timeout and
the watchdog need a hand on the engine and run in-process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ROOT, _wait_healthy, free_port, server_process, server_thread, sse_events

from flashserve.config import EngineConfig
from flashserve.engine.async_llm import AsyncLLM
from server.app import build_app
from server.settings import ServerSettings

TINY = ("--model", "dummy:tiny")
KEY = "s3cret-key"


def _long(max_tokens: int = 600, stream: bool = False) -> dict:
    """A completion of exactly ``max_tokens`` tokens (EOS ignored), long enough to hold a slot
    while the other requests of a test arrive."""
    return {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


# ---- admission control ---------------------------------------------------------------------

C, Q, K = 2, 2, 3


@pytest.fixture(scope="module")
def limited():
    args = ("--max-concurrent-requests", str(C), "--max-queued-requests", str(Q))
    with server_process(*TINY, *args, "--queue-timeout", "120") as base:
        yield base


def test_past_concurrency_and_queue_exactly_k_requests_get_429(limited):
    async def burst() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=limited, timeout=120) as ac:
            tasks = [asyncio.ensure_future(ac.post("/v1/completions", json=_long()))
                     for _ in range(C + Q + K)]  # fmt: skip
            while sum(t.done() for t in tasks) < K:  # the refusals come back at once
                await asyncio.sleep(0.01)
            # still full: each API refuses in its own shape (valid requests: admission comes
            # after validation)
            tgi = await ac.post("/generate", json={"inputs": "hi"})
            ids = await ac.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            return list(await asyncio.gather(*tasks)), tgi, ids

    t0 = time.monotonic()
    responses, tgi, ids = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * (C + Q) + [429] * K, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "server_error" and "overloaded" in err["message"], err
        else:
            assert r.json()["usage"]["completion_tokens"] == 600
    assert time.monotonic() - t0 < 100
    assert tgi.status_code == 429 and tgi.headers["retry-after"] == "1"
    assert tgi.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert ids.status_code == 429 and set(ids.json()["error"]) == {
        "message", "type", "param", "code"}  # fmt: skip
    # the slots came back: the server serves again, and says so in its metrics
    r = httpx.post(f"{limited}/v1/completions", json=_long(4), timeout=60)
    assert r.status_code == 200, r.text
    samples = _samples(limited)
    # the burst's K and the token-id request after them
    assert samples[("flashserve_http_requests_total", (("route", "/v1/completions"),
                                                       ("status", "429")))] == K + 1  # fmt: skip


def test_cors_is_off_by_default(limited):
    r = httpx.get(f"{limited}/info", headers={"Origin": "https://example.com"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.fixture()
def tiny_llm():
    return AsyncLLM(EngineConfig(model="dummy:tiny"))


def _slow_steps(monkeypatch, llm: AsyncLLM, seconds: float) -> None:
    runner = llm.engine.runner
    real = runner.execute
    monkeypatch.setattr(runner, "execute", lambda seqs: (time.sleep(seconds), real(seqs))[1])


def test_queue_timeout_is_503(tiny_llm, monkeypatch):
    _slow_steps(monkeypatch, tiny_llm, 0.02)
    settings = ServerSettings(max_concurrent_requests=1, max_queued_requests=1, queue_timeout=0.5)
    with server_thread(build_app(llm=tiny_llm, settings=settings)) as base:
        first = threading.Thread(
            target=httpx.post, args=(f"{base}/v1/completions",),
            kwargs={"json": _long(80), "timeout": 60},
        )  # fmt: skip
        first.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.post(f"{base}/generate", json={"inputs": "hi"}, timeout=30)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
        assert "queue" in r.json()["error"] and 0.4 < waited < 5, waited
        first.join()
        assert httpx.post(f"{base}/generate", json={"inputs": "hi"}, timeout=30).is_success


# ---- health, readiness, the watchdog -------------------------------------------------------


def test_health_is_503_while_the_engine_loop_hangs(tiny_llm, monkeypatch):
    """A step far longer than the stall timeout: dead while it lasts, alive again after."""
    runner, calls = tiny_llm.engine.runner, []
    real = runner.execute

    def hang_once(seqs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(2.0)
        return real(seqs)

    monkeypatch.setattr(runner, "execute", hang_once)
    settings = ServerSettings(stall_timeout=0.5)
    with server_thread(build_app(llm=tiny_llm, settings=settings)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 200
        time.sleep(1.0)  # idle longer than the stall timeout: still alive (nothing pending)
        assert httpx.get(f"{base}/health").status_code == 200
        worker = threading.Thread(target=httpx.post, args=(f"{base}/generate",),
                                  kwargs={"json": {"inputs": "hi"}, "timeout": 60})  # fmt: skip
        worker.start()
        time.sleep(1.0)
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and "no progress" in r.json()["error"], r.text
        assert httpx.get(f"{base}/ready").status_code == 503
        worker.join()
        assert httpx.get(f"{base}/health").status_code == 200


class _FakeLLM:
    """Stands in for AsyncLLM in the watchdog test: dead or alive on demand."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def stalled_reason(self, stall_timeout: float) -> str | None:
        return self.reason


@pytest.mark.parametrize("delay", [0.3, None])
def test_server_exits_1_after_the_engine_stays_dead(delay):
    """DrainingServer's watchdog: a dead engine that comes back resets the clock; one that stays
    dead for dead_exit_delay stops the server with exit status 1 (None: it never does)."""
    import uvicorn
    from fastapi import FastAPI

    from server.shutdown import DrainingServer

    app = FastAPI()
    llm = _FakeLLM()
    app.state.llm, app.state.ready, app.state.draining, app.state.in_flight = llm, True, False, 0
    app.state.settings = ServerSettings(dead_exit_delay=delay)
    server = DrainingServer(uvicorn.Config(app), app, shutdown_timeout=1.0)

    def ticks(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not server.should_exit:
            asyncio.run(server.on_tick(0))
            time.sleep(0.02)

    ticks(0.5)  # alive
    assert not server.should_exit
    llm.reason = "the engine is not running"
    ticks(0.15)  # dead, but not for long enough
    llm.reason = None
    ticks(0.25)  # back: the clock restarts
    assert not server.should_exit and server.exit_status == 0
    llm.reason = "the engine is not running"
    ticks(1.0)
    if delay is None:
        assert not server.should_exit and server.exit_status == 0
    else:
        assert server.should_exit and server.exit_status == 1


def test_sigterm_drains_streams_refuses_new_requests_and_exits_0():
    port = free_port()
    # the drain waits for the streams' 1,500 tokens: about 3 s on an idle machine, over 60 s on
    # a loaded one (an error event in place of the last chunk was seen so), hence 300
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *TINY,
           "--shutdown-timeout", "300"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(base, proc, log, 120)
            assert httpx.get(f"{base}/ready").status_code == 200
            results: dict[int, list[dict]] = {}
            started = threading.Barrier(3)
            streams = [threading.Thread(target=_stream_completion, args=(base, i, results,
                                                                         started))
                       for i in range(2)]  # fmt: skip
            for t in streams:
                t.start()
            started.wait(timeout=60)  # both streams have their first tokens
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert proc.poll() is None, "exited with streams in flight"
            r = httpx.post(f"{base}/generate", json={"inputs": "hi"}, timeout=10)
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            assert httpx.get(f"{base}/ready").status_code == 503
            assert httpx.get(f"{base}/health").status_code == 200
            for t in streams:
                t.join(timeout=320)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i in range(2):
        events = results[i]
        assert events[-1] == "[DONE]"
        assert all("choices" in e for e in events[:-1]), [e for e in events if "choices" not in e]
        finals = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
        assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]


def _stream_completion(base: str, i: int, results: dict, started: threading.Barrier) -> None:
    events: list = []
    body = {**_long(1500, stream=True)}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=320) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                events.append("[DONE]")
            elif line.startswith("data:"):
                events.extend(sse_events([line]))
                if len(events) == 2:
                    started.wait(timeout=60)
    results[i] = events


# ---- the API key and CORS ------------------------------------------------------------------

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def guarded():
    os.environ["FLASHSERVE_API_KEY"] = KEY  # read once by server/cli.py at start-up
    try:
        with server_process(*TINY, "--allowed-origins", ORIGIN) as base:
            yield base
    finally:
        del os.environ["FLASHSERVE_API_KEY"]


ROUTES = [
    ("GET", "/info", None),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/dummy:tiny", None),
    ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[p for _, p, _ in ROUTES])
def test_every_route_needs_the_key(guarded, method, path, body):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, guarded + path, json=body, headers=headers, timeout=60)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):  # fmt: skip
        r = call(headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()
        if path.startswith("/v1"):
            assert err["error"]["code"] == "invalid_api_key", err
        else:
            assert err == {"error": "invalid or missing API key", "error_type": "unauthorized"}
    r = call({"Authorization": f"Bearer {KEY}"})
    if path == "/v1/chat/completions":  # dummy:tiny has no chat template: a 400, past the key
        assert r.status_code == 400 and "chat template" in r.text, r.text
    else:
        assert r.status_code == 200, r.text


def test_probes_and_metrics_need_no_key(guarded):
    assert httpx.get(f"{guarded}/health").status_code == 200
    assert httpx.get(f"{guarded}/ready").status_code == 200
    assert httpx.get(f"{guarded}/metrics").status_code == 200


def test_cors_for_the_allowed_origins_only(guarded):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    r = httpx.options(f"{guarded}/generate", headers={"Origin": ORIGIN, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(f"{guarded}/generate", headers={"Origin": "https://evil.test", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{guarded}/info", headers={"Origin": ORIGIN, **auth})
    assert r.headers["access-control-allow-origin"] == ORIGIN


# ---- metrics -------------------------------------------------------------------------------


def _samples(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_by_the_right_amounts(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = _samples(guarded)
    prompt_tokens = 0
    with httpx.Client(base_url=guarded, headers=auth, timeout=60) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json=_long(5))
            assert r.status_code == 200, r.text
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        with c.stream("POST", "/v1/completions", json=_long(1500, stream=True)) as r:
            next(iter(sse_events(r.iter_lines())))  # one chunk, then the client goes away
        assert httpx.get(f"{guarded}/info").status_code == 401
    deadline = time.monotonic() + 10
    while _delta(before, _samples(guarded), "flashserve_aborted_requests_total") < 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    after = _samples(guarded)
    d = lambda name, **labels: _delta(before, after, name, **labels)  # noqa: E731
    assert d("flashserve_http_requests_total", route="/v1/completions", status="200") == 4
    assert d("flashserve_http_requests_total", route="/info", status="401") == 1
    assert d("flashserve_prompt_tokens_total") == prompt_tokens + prompt_tokens // 3
    generated = d("flashserve_generation_tokens_total")
    assert 15 < generated < 15 + 1500
    assert d("flashserve_aborted_requests_total") == 1
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert d(f"flashserve_{hist}_seconds_count") == 4, hist
        assert d(f"flashserve_{hist}_seconds_sum") > 0 or hist == "request_queue_time"
    assert d("flashserve_inter_token_latency_seconds_count") == generated - 4
    assert after[("flashserve_num_requests_running", ())] == 0
    assert after[("flashserve_num_requests_waiting", ())] == 0
    assert after[("flashserve_kv_cache_usage_ratio", ())] == 0.0
    assert after[("flashserve_num_preemptions_total", ())] == 0


def test_metrics_show_resident_memory_and_no_gpu_gauges_on_cpu(guarded):
    samples = _samples(guarded)
    # the server process's, from prometheus_client's process collector (it reads /proc)
    assert samples[("process_resident_memory_bytes", ())] > 10 * 2**20
    assert not any(name.startswith("flashserve_gpu_memory") for name, _ in samples)


def test_gpu_memory_gauges_read_the_engine_device():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from flashserve.engine.messages import EngineStats
    from server.metrics import _EngineCollector

    stats = EngineStats(time.monotonic(), running=1, waiting=0, kv_usage=0.5, preemptions=0,
                        unfinished=1, gpu_memory=(3 * 2**30, 4 * 2**30))  # fmt: skip
    llm = SimpleNamespace(stats=lambda: stats)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(SimpleNamespace(state=SimpleNamespace(llm=llm))))
    text = generate_latest(registry).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["flashserve_gpu_memory_allocated_bytes"] == 3 * 2**30
    assert values["flashserve_gpu_memory_reserved_bytes"] == 4 * 2**30
    assert values["flashserve_kv_cache_usage_ratio"] == 0.5


# ---- units: the admission queue and the settings -------------------------------------------


def test_admission_hands_slots_over_in_order_and_survives_cancelled_waiters():
    from server.admission import Admission
    from server.errors import APIError

    async def scenario() -> None:
        adm = Admission(max_concurrent=1, max_queued=2, queue_timeout=5)
        await adm.acquire()
        order: list[str] = []

        async def wait(name: str) -> None:
            await adm.acquire()
            order.append(name)

        a, gone, b = (asyncio.ensure_future(wait(n)) for n in ("a", "gone", "b"))
        await asyncio.sleep(0.01)
        assert adm.waiting == 2 and b.done(), "the third waiter is over the queue"
        assert isinstance(b.exception(), APIError) and b.exception().status_code == 429
        gone.cancel()
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        adm.release()
        await asyncio.sleep(0.01)
        assert order == ["a"] and adm.running == 1
        adm.release()
        assert adm.running == 0 and adm.waiting == 0
        adm.queue_timeout = 0.05
        await adm.acquire()
        with pytest.raises(APIError) as err:
            await adm.acquire()
        assert err.value.status_code == 503 and adm.waiting == 0

    asyncio.run(scenario())


def test_admission_counts_slots_first_come_first_served():
    """A waiter for k slots at the head keeps smaller ones behind it waiting (no starving);
    when it leaves, the one behind takes what is free at once."""
    from server.admission import Admission

    async def scenario() -> None:
        adm = Admission(max_concurrent=3, max_queued=2, queue_timeout=5)
        await adm.acquire(2)
        big = asyncio.ensure_future(adm.acquire(3))
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(adm.acquire(1))  # one slot is free, but big is first
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and adm.waiting == 2 and adm.running == 2
        big.cancel()
        await asyncio.sleep(0.01)
        assert small.done() and adm.running == 3 and adm.waiting == 0
        adm.release(2)
        adm.release(1)
        assert adm.running == 0
        with pytest.raises(ValueError):
            await adm.acquire(4)  # could never run: the routes refuse it first (400)

    asyncio.run(scenario())


def test_serve_settings_from_the_command_line(monkeypatch):
    import argparse

    from flashserve.cli.args import CLIError
    from server.cli import _add_serve_args, settings_from_args

    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    monkeypatch.setenv("FLASHSERVE_API_KEY", "from-env")
    args = parser.parse_args(["--allowed-origins", "https://a.test,https://b.test",
                              "--allowed-origins", "https://c.test"])  # fmt: skip
    s = settings_from_args(args)
    assert s.api_key == "from-env" and s.max_concurrent_requests is None
    assert s.allowed_origins == ("https://a.test", "https://b.test", "https://c.test")
    assert settings_from_args(parser.parse_args(["--api-key", "flag"])).api_key == "flag"
    assert settings_from_args(parser.parse_args(["--api-key", " flag\n"])).api_key == "flag"
    monkeypatch.setenv("FLASHSERVE_API_KEY", "\tfrom-env\r\n")
    assert settings_from_args(parser.parse_args([])).api_key == "from-env"
    monkeypatch.delenv("FLASHSERVE_API_KEY")
    s = settings_from_args(parser.parse_args([]))
    assert s.api_key is None and s.max_request_bytes is None and s.request_read_timeout == 30
    assert s.request_bytes_limit(8192) == 2**20 and s.request_bytes_limit(131072) == 4 * 2**20
    assert s.max_choices_per_request == 256
    for bad in (["--max-concurrent-requests", "0"], ["--queue-timeout", "0"],
                ["--max-queued-requests", "-1"], ["--max-request-bytes", "0"],
                ["--request-read-timeout", "0"], ["--max-choices-per-request", "0"],
                ["--api-key", " "]):  # fmt: skip
        with pytest.raises(CLIError) as err:
            settings_from_args(parser.parse_args(bad))
        assert err.value.status == 2
