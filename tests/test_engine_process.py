"""``flashserve serve`` runs the engine core in a process of its own: faults across the process
boundary, each against a real server (``python -m server serve`` on ``dummy:tiny``).

- the core dies (SIGKILL, or an exception in its loop): open requests end with an error (424
  or an error event), /health says 503 within a second, the server exits 1 after
  ``--dead-exit-delay``;
- the front end dies (SIGKILL): the core exits within 5 s, no process is left behind;
- SIGTERM (to the front end, or to the whole process group): both drain and exit 0;
- /metrics shows the core's gauges (from its stats snapshots) moving with the load;
- with ``--tensor-parallel-size 2`` the core is rank 0 and starts rank 1, its child: a killed
  rank 1 kills the core as above (open requests end with an error, 503, exit 1), and the
  front end's death takes both ranks with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ROOT, _tail, _wait_healthy, free_port, sse_events

from flashserve.engine.messages import (
    STATS_PERIOD_S,
    AddRequest,
    Codec,
    EngineStats,
    StepMessage,
    from_wire,
    to_wire,
)
from flashserve.engine.outputs import RequestOutput, TokenOutput
from flashserve.sampling.params import SamplingParams

TINY = ("--model", "dummy:tiny")
LONG = 1500  # tokens: a request still running when the test acts (seconds, on 2 vCPUs)
FAULTS = Path(__file__).parent / "faults"  # its sitecustomize.py injects faults in the core


# ---- the messages ----------------------------------------------------------------------------


def test_outputs_cross_as_text_deltas_and_never_carry_the_prompt():
    """Per token, a message carries the text that token added, not the text so far nor the
    prompt; the final one carries the whole text, which a stop string may have cut; the
    front end rebuilds every RequestOutput as the engine made it."""
    codec, prompt = Codec(), list(range(30_000))
    texts = ["Hel", "Hello", "Hello, wor", "Hello"]  # the last: finished, a stop string cut
    outs = [_output(i, t, finished=i == 3, prompt=prompt) for i, t in enumerate(texts)]
    sent, text, sizes = 0, "", []
    for out in outs:
        frame = codec.encode(StepMessage([to_wire(out, sent)], EngineStats(0.0, 1, 0, 0.1, 0, 1)))
        sizes.append(len(frame))
        sent = len(out.generated_text)
        (w,) = codec.step.decode(frame).outputs
        text = w.text if w.finished else text + w.text
        assert from_wire(w, text, prompt) == out
    assert max(sizes) < 200, sizes  # the 30,000 prompt ids never travel with an output
    add = AddRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=5, stop=["x"], seed=1))
    assert codec.to_core.decode(codec.encode(add)) == add


def _output(i: int, text: str, finished: bool, prompt: list[int]) -> RequestOutput:
    token = TokenOutput(i, text[-2:], -0.5, False, [(i, "x", -0.1)])
    return RequestOutput(
        "r", [token], finished, finish_reason="stop_sequence" if finished else None,
        generated_text=text, num_prompt_tokens=len(prompt), num_generated_tokens=i + 1, seed=7,
        prompt_token_ids=prompt, held_back=0 if finished else 1,
    )  # fmt: skip


# ---- the server's processes -------------------------------------------------------------------


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: object

    @property
    def core(self) -> psutil.Process:
        """The engine core: the front end's child that multiprocessing spawned."""
        for child in psutil.Process(self.proc.pid).children():
            if "spawn_main" in " ".join(child.cmdline()):
                return child
        raise AssertionError(f"no engine core process:\n{_tail(self.log)}")

    @property
    def tp_worker(self) -> psutil.Process:
        """Tensor-parallel rank 1: the core's child that multiprocessing spawned."""
        for child in self.core.children():
            if "spawn_main" in " ".join(child.cmdline()):
                return child
        raise AssertionError(f"no tensor-parallel worker process:\n{_tail(self.log)}")

    def log_text(self) -> str:
        return _tail(self.log, 100_000)


@contextmanager
def server(*args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A server process whose handle the test keeps (to signal it and read its exit status);
    killed, with every process under it, at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *TINY, *args]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})  # fmt: skip
        family: list[psutil.Process] = []
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, log, 120)
            family = psutil.Process(proc.pid).children(recursive=True)
            yield Server(url, proc, log)
        finally:
            for p in [*family, psutil.Process(proc.pid)] if proc.poll() is None else family:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait()


def _wait_for(condition: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def _gone(p: psutil.Process) -> bool:
    """Exited (a zombie waiting for a reaper counts: it holds no memory)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("flashserve_") and not s.labels}  # fmt: skip


async def _open_requests(
    url: str, n_streams: int
) -> tuple[httpx.AsyncClient, list[asyncio.Task], asyncio.Task]:
    """``n_streams`` streams (TGI and OpenAI, alternating) that have their first token, and a
    non-streamed /generate in flight, all of LONG tokens; with their client."""
    ac = httpx.AsyncClient(base_url=url, timeout=60)
    tgi = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
    cmpl = {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    plain = asyncio.ensure_future(ac.post("/generate", json=tgi))
    streams, tasks = [], []
    for i in range(n_streams):
        route, body = ("/generate_stream", tgi) if i % 2 == 0 else ("/v1/completions", cmpl)
        first = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.ensure_future(_stream(ac, route, body, first)))
        streams.append(first)
    await asyncio.gather(*streams)
    return ac, tasks, plain


async def _stream(ac: httpx.AsyncClient, route: str, body: dict, first: asyncio.Future) -> list:
    """Every ``data:`` line of a stream; ``first`` is set once its first token came."""
    lines = []
    async with ac.stream("POST", route, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if not first.done():
                    first.set_result(None)
    return lines


def _assert_ended_with_error(lines: list[str], plain: httpx.Response) -> None:
    if lines[-1] == "data: [DONE]":  # OpenAI: the error event, then [DONE]
        err = list(sse_events(lines[-2:-1]))[0]["error"]
        assert err["type"] == "server_error" and "engine" in err["message"], err
    else:
        err = list(sse_events(lines[-1:]))[0]
        assert err["error_type"] == "generation" and "engine" in err["error"], err
    assert plain.status_code == 424 and plain.json()["error_type"] == "generation", plain.text


def _core_dies_mid_stream(srv: Server, kill: Callable[[], None]) -> float:
    """Open requests end with an error, /health says 503, the server exits 1 after its
    --dead-exit-delay (2 s). Returns the seconds from ``kill()`` to the requests' end."""

    async def scenario() -> tuple[list[list[str]], httpx.Response, float]:
        ac, tasks, plain = await _open_requests(srv.url, 2)
        t0 = time.monotonic()
        kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks, plain), 30)
        await ac.aclose()
        return results[:-1], results[-1], time.monotonic() - t0

    streams, plain, took = asyncio.run(scenario())
    t0 = time.monotonic()
    for lines in streams:
        _assert_ended_with_error(lines, plain)
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 503 and "engine core process died" in r.json()["error"], r.text
    assert httpx.post(f"{srv.url}/generate", json={"inputs": "hi"}).status_code == 503
    assert srv.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 >= 1.5, "exited before --dead-exit-delay"
    return took


def test_sigkilled_core_fails_open_requests_health_503_and_exit_1():
    with server("--dead-exit-delay", "2") as srv:
        core, unhealthy = srv.core, []

        def kill_and_watch_health() -> None:
            core.send_signal(signal.SIGKILL)
            watch = lambda: unhealthy.append(
                _wait_for(  # noqa: E731
                    lambda: httpx.get(f"{srv.url}/health").status_code == 503, "a 503", 5
                )
            )
            threading.Thread(target=watch).start()

        took = _core_dies_mid_stream(srv, kill_and_watch_health)
        assert took < 5.0, f"the open requests took {took:.1f} s to end"  # not a timeout
        assert unhealthy and unhealthy[0] < 1.0, unhealthy
        assert "died (signal 9)" in srv.log_text()


def test_exception_in_the_core_loop_fails_open_requests_and_exits_1():
    env = {"PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]),
           "FLASHSERVE_TEST_CORE_FAULT": "40"}  # fmt: skip
    with server("--dead-exit-delay", "2", env=env) as srv:
        _core_dies_mid_stream(srv, lambda: None)  # the loop breaks on its 40th token message
        log = srv.log_text()
        assert "injected: the engine core loop broke" in log, log[-3000:]
        assert "died (status 1)" in log


def test_sigkilled_front_end_takes_the_core_with_it():
    with server() as srv:
        core = srv.core
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        assert core in family
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        took = _wait_for(lambda: all(_gone(p) for p in family), "the core to exit", 5)
        assert took < 5


def test_sigterm_to_the_process_group_drains_and_both_exit_0():
    """SIGTERM to every process of the server (a service manager's stop, a Ctrl-C): the core
    ignores its own, the front end drains, the stream in flight finishes, then the core stops
    cleanly and the server exits 0 (SIGTERM to the front end alone: test_production.py)."""
    with server("--shutdown-timeout", "60") as srv:
        core = srv.core
        tgi = {"inputs": "hello", "parameters": {"max_new_tokens": 400, "details": True}}
        with httpx.stream("POST", f"{srv.url}/generate_stream", json=tgi, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            core.send_signal(signal.SIGTERM)
            srv.proc.send_signal(signal.SIGTERM)
            events = list(sse_events(lines))
        assert events[-1]["details"]["generated_tokens"] == 400, events[-1]
        assert srv.proc.wait(timeout=60) == 0
        assert _gone(core)
        assert "the engine core stopped with status 0" in srv.log_text()


def test_metrics_gauges_follow_the_core_and_a_disconnect_frees_the_kv_cache():
    with server() as srv:
        idle = _gauges(srv.url)
        assert idle["flashserve_num_requests_running"] == 0
        assert idle["flashserve_kv_cache_usage_ratio"] == 0

        async def load() -> None:
            ac, tasks, plain = await _open_requests(srv.url, 2)
            # the streams have their first tokens; the plain request may still be on its way,
            # and the core publishes its stats every STATS_PERIOD_S: wait for a snapshot of 3
            for _ in range(100):
                busy = _gauges(srv.url)
                if busy["flashserve_num_requests_running"] == 3:
                    break
                await asyncio.sleep(0.1)
            assert busy["flashserve_num_requests_running"] == 3, busy
            assert busy["flashserve_kv_cache_usage_ratio"] > 0, busy
            for t in [*tasks, plain]:
                t.cancel()  # the clients go away
            await asyncio.gather(*tasks, plain, return_exceptions=True)
            await ac.aclose()

        asyncio.run(load())
        took = _wait_for(lambda: _gauges(srv.url)["flashserve_kv_cache_usage_ratio"] == 0,
                         "the KV cache to be freed", 10)  # fmt: skip
        assert took < 2 * STATS_PERIOD_S + 1, took
        assert _gauges(srv.url)["flashserve_num_requests_running"] == 0


def test_a_killed_tensor_parallel_worker_fails_open_requests_health_503_and_exit_1():
    with server("--dead-exit-delay", "2", "--tensor-parallel-size", "2") as srv:
        assert httpx.get(f"{srv.url}/info").json()["tensor_parallel_size"] == 2
        worker = srv.tp_worker
        took = _core_dies_mid_stream(srv, lambda: worker.send_signal(signal.SIGKILL))
        assert took < 5.0, f"the open requests took {took:.1f} s to end"  # not a timeout
        log = srv.log_text()
        assert "tensor-parallel worker rank 1 died (signal 9)" in log, log[-3000:]
        assert "died (status 1)" in log


def test_sigkilled_front_end_takes_both_tensor_parallel_ranks_with_it():
    with server("--tensor-parallel-size", "2") as srv:
        ranks = [srv.core, srv.tp_worker]
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        took = _wait_for(lambda: all(_gone(p) for p in ranks), "both ranks to exit", 10)
        assert took < 10
