"""The HTTP ingress under attack (issue 12), against the real server process on ``dummy:tiny``:
huge and slow bodies, admission that counts engine requests and forgets clients that left,
tokenizing off the event loop, the API key's whitespace, streams cut by the shutdown.

Raw sockets send what ``httpx`` will not: headers alone, half a body, a body that never ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_utils import ROOT, _wait_healthy, free_port, server_process, sse_events
from tokenizer_helpers import HARD_TEXTS, build_spm_gguf, default_gguf_path, random_text

from flashserve.tokenizer.tokenizer import Tokenizer

TINY = ("--model", "dummy:tiny")
C, Q = 2, 1  # slots and queue places of the limited server
READ_TIMEOUT = 1.5
BODY_LIMIT = 1_100_000  # bytes: room for the 1 MB prompt of the /health test
LONG_TGI = {"inputs": "hello", "parameters": {"max_new_tokens": 1500}}
SHORT_TGI = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def limited():
    args = ("--max-concurrent-requests", str(C), "--max-queued-requests", str(Q),
            "--request-read-timeout", str(READ_TIMEOUT), "--max-request-bytes", str(BODY_LIMIT),
            "--queue-timeout", "60")  # fmt: skip
    with server_process(*TINY, *args) as base:
        yield base


# ---- raw HTTP ----------------------------------------------------------------------------------


def _connect(base: str) -> socket.socket:
    url = urlsplit(base)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def _head(path: str, length: int | None = None) -> bytes:
    """A POST's request line and headers: with ``length``, a Content-Length; else chunked."""
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()  # fmt: skip


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return _head(path, len(data)) + data


def _answer(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of the response on ``sock`` (the server closes it)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


# ---- body size (finding 2) -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_declared_huge_body_is_413_at_once_without_reading(limited, path):
    with _connect(limited) as sock:
        sock.sendall(_head(path, 50 * 2**20))  # 50 MB announced, none sent
        t0 = time.monotonic()
        status, headers, body = _answer(sock, timeout=10)
    assert status == 413 and time.monotonic() - t0 < 2
    assert headers["connection"] == "close"
    message = body["error"] if path == "/generate" else body["error"]["message"]
    assert f"limit of {BODY_LIMIT} bytes" in message, body
    if path == "/generate":
        assert body["error_type"] == "validation"
    else:
        assert body["error"]["type"] == "invalid_request_error"


def test_chunked_body_is_413_once_past_the_limit(limited):
    def chunk(size: int) -> bytes:
        return b"%x\r\n%s\r\n" % (size, b"x" * size)

    with _connect(limited) as sock:
        sock.sendall(_head("/generate"))
        sent = 0
        while sent < BODY_LIMIT:  # up to the limit: still read
            size = min(65536, BODY_LIMIT - sent)
            sock.sendall(chunk(size))
            sent += size
        time.sleep(0.3)  # all read: the refusal below leaves nothing unread (no reset)
        sock.sendall(chunk(1))  # one byte past the limit, and the body never ends
        status, _, body = _answer(sock, timeout=10)
    assert status == 413 and body["error_type"] == "validation", body


def test_text_longer_than_the_context_is_refused_before_tokenizing(limited):
    """1 MB of text is ~1M tokens on a byte-level vocabulary (seconds to tokenize); the
    context is 2048 tokens: refused from its length alone."""
    t0 = time.monotonic()
    r = httpx.post(f"{limited}/generate", json={"inputs": "ab " * 330_000}, timeout=30)
    assert r.status_code == 422 and "at least" in r.json()["error"], r.text
    r = httpx.post(f"{limited}/v1/completions", json={"prompt": "ab " * 330_000}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 1.5


def test_health_answers_while_a_long_prompt_is_tokenized(limited):
    """``truncate`` legitimately takes text longer than the context: the whole text is
    tokenized (~2 s here), on a worker thread that lets the event loop run."""
    body = {"inputs": "ab " * 330_000, "parameters": {"truncate": 16, "max_new_tokens": 2,
                                                      "details": True}}  # fmt: skip
    done: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: done.append(httpx.post(
        f"{limited}/generate", json=body, timeout=60)))  # fmt: skip
    latencies = []
    with httpx.Client(base_url=limited, timeout=5) as c:
        # the connection is open, and the engine's first step (~100 ms of lazy set-up that
        # holds the GIL, once per process) is done, before the measure starts
        assert c.post("/generate", json=SHORT_TGI, timeout=30).status_code == 200
        t0 = time.monotonic()
        worker.start()
        while worker.is_alive():
            start = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    took = time.monotonic() - t0
    assert done[0].status_code == 200, done[0].text
    assert done[0].json()["details"]["generated_tokens"] == 2
    assert took > 0.5, f"too quick ({took:.2f} s) to show anything"
    assert max(latencies) < 0.1, f"/health took {max(latencies) * 1000:.0f} ms"


# ---- slow bodies and admission (findings 3, 5, 6) ----------------------------------------------


def test_slow_bodies_hold_no_slot_and_get_408(limited):
    paths = ["/generate", "/v1/completions"] * 2  # more than the slots and the queue
    socks = [_connect(limited) for _ in paths]
    try:
        for sock, path in zip(socks, paths):
            sock.sendall(_head(path, 100) + b"{")  # and then nothing
        time.sleep(0.2)
        for _ in range(3):  # everyone else is served meanwhile
            r = httpx.post(f"{limited}/generate", json=SHORT_TGI, timeout=30)
            assert r.status_code == 200, r.text
        t0 = time.monotonic()
        answers = [_answer(sock, timeout=10) for sock in socks]
        assert time.monotonic() - t0 < READ_TIMEOUT + 2
    finally:
        for sock in socks:
            sock.close()
    for (status, headers, body), path in zip(answers, paths):
        assert status == 408 and headers["connection"] == "close", body
        if path == "/generate":
            assert body["error_type"] == "timeout" and "did not arrive" in body["error"], body
        else:
            assert "did not arrive" in body["error"]["message"], body


async def _open_stream(ac: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    """A streaming request whose 200 is in (it holds its slots until closed)."""
    r = await ac.send(ac.build_request("POST", path, json=body), stream=True)
    assert r.status_code == 200, await r.aread()
    return r


async def _pending(task: asyncio.Future, seconds: float = 0.5) -> bool:
    await asyncio.sleep(seconds)
    return not task.done()


def test_a_waiter_that_disconnects_leaves_the_queue(limited):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=limited, timeout=60) as ac:
            holders = [await _open_stream(ac, "/generate_stream", LONG_TGI) for _ in range(C)]
            gone = _connect(limited)
            gone.sendall(_post("/generate", SHORT_TGI))  # takes the one queue place
            await asyncio.sleep(0.3)
            r = await ac.post("/generate", json=SHORT_TGI)
            assert r.status_code == 429, "the queue should be full"
            gone.close()  # the waiter goes away: its place is free at once
            await asyncio.sleep(0.3)
            waiter = asyncio.ensure_future(ac.post("/generate", json=SHORT_TGI))
            assert await _pending(waiter), f"not queued: {waiter.result().text}"
            await holders[0].aclose()
            r = await waiter
            assert r.status_code == 200, r.text
            await holders[1].aclose()

    asyncio.run(scenario())


def test_each_generation_takes_a_slot(limited):
    """n=2 takes both slots: of two more requests one waits (the queue place), one is
    refused; n above the slots, or prompts x n above the per-request bound, is a 400."""
    stream = {"prompt": "hello", "n": 2, "max_tokens": 1500, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=limited, timeout=60) as ac:
            holder = await _open_stream(ac, "/v1/completions", stream)
            tasks = [asyncio.ensure_future(ac.post("/generate", json=SHORT_TGI))
                     for _ in range(2)]  # fmt: skip
            done, pending = await asyncio.wait(tasks, timeout=5, return_when="FIRST_COMPLETED")
            assert len(done) == 1 and (await done.pop()).status_code == 429
            assert await _pending(pending.pop())
            await holder.aclose()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert sorted(r.status_code for r in results) == [200, 429]

    asyncio.run(scenario())
    r = httpx.post(f"{limited}/v1/completions", json={"prompt": "hi", "n": C + 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert f"at most {C} at once" in r.json()["error"]["message"]
    r = httpx.post(f"{limited}/v1/completions", json={"prompt": ["hi"] * 300}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "300 completions" in r.json()["error"]["message"]
    assert "at most 256 per request" in r.json()["error"]["message"]


# ---- the tokenizer's bound ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["byte-level", "smollm2-gguf", "sentencepiece-gguf"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    """The three kinds the engine loads: dummy models' bytes, the default model's byte-level
    BPE (tokens up to 81 characters), a SentencePiece vocabulary with a normalizer."""
    if request.param == "byte-level":
        return Tokenizer.byte_level(512, 1, 2)
    if request.param == "smollm2-gguf":
        return Tokenizer.from_gguf(default_gguf_path())
    return Tokenizer.from_gguf(build_spm_gguf(tmp_path_factory.mktemp("spm"))[1])


def test_min_tokens_never_exceeds_the_token_count(tokenizer):
    rng = random.Random(12)
    runs = ["#" * 500, "=" * 300, " " * 400, "\n" + " " * 200, "ab" * 300, "日本" * 100]
    texts = [t for t in HARD_TEXTS if t] + runs + [random_text(rng, 200) for _ in range(200)]
    assert tokenizer.max_token_chars is not None and tokenizer.max_token_chars >= 7
    for text in texts:
        least, count = tokenizer.min_tokens(text), len(tokenizer.encode(text))
        assert 0 < least <= count, (text[:40], least, count, tokenizer.max_token_chars)


# ---- the API key (finding 9) -------------------------------------------------------------------


def test_api_key_with_surrounding_whitespace_is_stripped(monkeypatch):
    monkeypatch.setenv("FLASHSERVE_API_KEY", "secret\n")  # as `$(cat keyfile)` may leave it
    with server_process(*TINY) as base:
        r = httpx.get(f"{base}/info", headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200, r.text
        r = httpx.get(f"{base}/info", headers={"Authorization": "Bearer other"})
        assert r.status_code == 401


@pytest.mark.parametrize(("env", "args", "named"), [
    (" \n", (), "$FLASHSERVE_API_KEY"),
    (None, ("--api-key", "  "), "--api-key"),
])  # fmt: skip
def test_blank_api_key_is_refused_at_start_up(env, args, named):
    environ = {k: v for k, v in os.environ.items() if k != "FLASHSERVE_API_KEY"}
    if env is not None:
        environ["FLASHSERVE_API_KEY"] = env
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(free_port()), *TINY, *args]
    done = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, done.stderr


# ---- shutdown (finding 10) ---------------------------------------------------------------------


def test_streams_cut_by_the_shutdown_timeout_end_with_an_error_event():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *TINY,
           "--shutdown-timeout", "1"]  # fmt: skip
    long_oai = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    routes = [("/generate_stream", {**LONG_TGI, "parameters": {"max_new_tokens": 2000}}),
              ("/v1/completions", long_oai)]  # fmt: skip
    events: dict[str, list[str]] = {}
    started = threading.Barrier(len(routes) + 1)

    def stream(path: str, body: dict) -> None:
        lines = []
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) == 1:
                        started.wait(timeout=60)
        events[path] = lines

    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(base, proc, log, 120)
            threads = [threading.Thread(target=stream, args=route) for route in routes]
            for t in threads:
                t.start()
            started.wait(timeout=60)
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(timeout=60)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert "Traceback" not in output, output[-4000:]
    tgi = list(sse_events(events["/generate_stream"]))
    assert len(tgi) > 1 and "token" in tgi[0], tgi[:2]
    assert tgi[-1] == {"error": "the server is shutting down", "error_type": "generation"}
    oai = events["/v1/completions"]
    assert oai[-1] == "data: [DONE]", oai[-3:]
    last = list(sse_events(oai[-2:-1]))[0]
    assert last["error"]["message"] == "the server is shutting down", last
