"""Helpers for the server tests: a real server process, an in-process one, SSE parsing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(*args: str, timeout: float = 180.0, log_path: Path | None = None
                   ) -> Iterator[str]:  # fmt: skip
    """``python -m server serve ARGS`` on a free port; yields its base URL once /health says
    200, and stops it at the end. A server that dies or never gets healthy fails with the tail
    of its log. ``log_path``: keep the server's output there (a temporary file otherwise)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *args]
    with open(log_path, "w+b") if log_path else tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, log, timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the server was not healthy after {timeout} s:\n{_tail(log)}")


def _tail(log, size: int = 4000) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]


@contextmanager
def server_thread(app: FastAPI, timeout: float = 120.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread of this process (so that a test can reach the
    engine behind it); yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON payload of each ``data:`` line of a Server-Sent Events stream."""
    for line in lines:
        if line.startswith("data:"):
            yield json.loads(line[len("data:") :])
