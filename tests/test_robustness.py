"""The server under abuse, in-process on ``dummy:tiny`` (a hand on the engine behind it): a storm
of clients that go away mid-stream, a forward pass that fails, an engine thread that dies.

After each, the engine must be clean (no running or waiting sequence, every KV block free) and
serve again, or, when it cannot, say so on ``/health``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import server_thread, sse_events

from flashserve.async_llm import AsyncLLM
from flashserve.config import EngineConfig
from server.app import build_app

ABORTED = "flashserve_aborted_requests_total"
LONG = 1500  # tokens: a stream that is still running when its client goes away
STEP_S = 0.005  # a slower step keeps the long requests alive while a test acts


@pytest.fixture(params=[False, True], ids=["plain", "async-scheduling"])
def llm(request, monkeypatch) -> AsyncLLM:
    """A fresh engine on dummy:tiny whose steps take at least ``STEP_S``: plain, and with
    async scheduling (the default on CUDA), whose decode steps go through ``launch``."""
    llm = AsyncLLM(EngineConfig(model="dummy:tiny", async_scheduling=request.param))
    runner = llm.engine.runner
    execute, launch = runner.execute, runner.launch
    monkeypatch.setattr(runner, "execute", lambda seqs: (time.sleep(STEP_S), execute(seqs))[1])
    monkeypatch.setattr(runner, "launch", lambda *a: (time.sleep(STEP_S), launch(*a))[1])
    return llm


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _engine_is_clean(llm: AsyncLLM) -> bool:
    engine = llm.engine
    return (
        not engine.has_unfinished()
        and engine.scheduler.num_running == 0
        and engine.scheduler.num_waiting == 0
        and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    )


def _samples(base: str) -> dict[str, float]:
    """The unlabelled samples of /metrics, by name."""
    text = httpx.get(f"{base}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


# the streaming routes, each with a body that runs for LONG tokens
STREAMS = [
    ("/generate_stream", {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}),
    ("/", {"inputs": "hello", "parameters": {"max_new_tokens": LONG}, "stream": True}),
    (
        "/v1/completions",
        {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True, "stream": True},
    ),  # fmt: skip
]


# ---- a storm of disconnects ----------------------------------------------------------------


def test_disconnect_storm_frees_everything(llm):
    n = 24
    with server_thread(build_app(llm=llm)) as base:
        before = _samples(base)

        async def cut_after_first_token(ac: httpx.AsyncClient, i: int) -> None:
            route, body = STREAMS[i % len(STREAMS)]
            async with ac.stream("POST", route, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"error' not in line:
                        return  # one token, then the client goes away
            raise AssertionError(f"{route}: the stream ended before its first token")

        async def storm() -> None:
            limits = httpx.Limits(max_connections=n)
            async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as ac:
                await asyncio.gather(*(cut_after_first_token(ac, i) for i in range(n)))

        t0 = time.monotonic()
        asyncio.run(storm())
        _wait_for(lambda: _engine_is_clean(llm), "the engine to drop every aborted stream", 10)
        cleaned = time.monotonic() - t0
        aborted = lambda: _samples(base)[ABORTED] - before[ABORTED]  # noqa: E731
        _wait_for(lambda: aborted() >= n, "the aborts to be counted")
        after = _samples(base)
        assert after[ABORTED] - before[ABORTED] == n
        assert after["flashserve_num_requests_running"] == 0
        assert after["flashserve_num_requests_waiting"] == 0
        assert after["flashserve_kv_cache_usage_ratio"] == 0.0
        assert cleaned < 20, cleaned
        r = httpx.post(f"{base}/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 3, "details": True}}, timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 3, r.text
        assert httpx.get(f"{base}/health").status_code == 200


# ---- a failing forward pass ----------------------------------------------------------------


def _arm_fault(monkeypatch, llm: AsyncLLM) -> threading.Event:
    """The next forward pass (run now, or queued with async scheduling) after ``armed`` is
    set raises (once)."""
    runner = llm.engine.runner
    execute, launch, armed = runner.execute, runner.launch, threading.Event()

    def fault() -> None:
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected: the device fell over")

    monkeypatch.setattr(runner, "execute", lambda seqs: (fault(), execute(seqs))[1])
    monkeypatch.setattr(runner, "launch", lambda *a: (fault(), launch(*a))[1])
    return armed


def test_failed_forward_pass_fails_its_requests_then_the_engine_serves_again(llm, monkeypatch):
    armed = _arm_fault(monkeypatch, llm)
    tgi = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
    cmpl = {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True}
    with server_thread(build_app(llm=llm)) as base:

        async def stream(ac: httpx.AsyncClient, route: str, body: dict) -> list[str]:
            async with ac.stream("POST", route, json=body) as r:
                assert r.status_code == 200, await r.aread()
                return [line async for line in r.aiter_lines() if line.startswith("data:")]

        async def requests() -> list:
            async with httpx.AsyncClient(base_url=base, timeout=60) as ac:
                tasks = [
                    asyncio.ensure_future(ac.post("/generate", json=tgi)),
                    asyncio.ensure_future(ac.post("/v1/completions", json=cmpl)),
                    asyncio.ensure_future(stream(ac, "/generate_stream", tgi)),
                    asyncio.ensure_future(stream(ac, "/v1/completions", {**cmpl, "stream": True})),
                ]
                deadline = time.monotonic() + 15
                while llm.engine.scheduler.num_running < len(tasks):  # all in the batch
                    assert time.monotonic() < deadline, "the requests did not all start"
                    await asyncio.sleep(0.01)
                armed.set()
                return await asyncio.gather(*tasks)

        tgi_r, oai_r, tgi_events, oai_events = asyncio.run(requests())
        assert tgi_r.status_code == 424, tgi_r.text
        assert tgi_r.json()["error_type"] == "generation"
        assert "the device fell over" in tgi_r.json()["error"]
        assert oai_r.status_code == 424, oai_r.text
        err = oai_r.json()["error"]
        assert err["type"] == "server_error" and "the device fell over" in err["message"], err
        last = list(sse_events(tgi_events))[-1]
        assert last["error_type"] == "generation" and "fell over" in last["error"], last
        assert oai_events[-1] == "data: [DONE]"
        last = list(sse_events(oai_events[:-1]))[-1]
        assert last["error"]["type"] == "server_error", last
        assert "fell over" in last["error"]["message"], last

        _wait_for(lambda: _engine_is_clean(llm), "the engine to free the failed requests")
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={**cmpl, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert _engine_is_clean(llm)


# ---- an engine thread that dies --------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_fails_open_requests_and_health_says_503(llm, monkeypatch):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
    with server_thread(build_app(llm=llm)) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            with c.stream("POST", "/generate_stream", json=body) as r:
                events = sse_events(r.iter_lines())
                assert "token" in next(events)

                def broken_inbox() -> None:  # outside the step's guard: the thread dies
                    raise RuntimeError("injected: the engine loop broke")

                monkeypatch.setattr(llm, "_drain_inbox", broken_inbox)
                rest = list(events)  # must end, not hang on a dead thread
            assert rest and rest[-1]["error_type"] == "generation", rest[-3:]
            assert "engine loop broke" in rest[-1]["error"]
            _wait_for(lambda: not llm.is_running, "the engine thread to die")
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            assert c.get("/ready").status_code == 503
            r = c.post("/generate", json={"inputs": "hi"})
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert isinstance(llm.error, RuntimeError)
