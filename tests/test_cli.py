"""The command line, run as users run it: the console script and ``python -m``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "dummy:tiny"]


def _run(*args: str, module: str = "server", timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generate_prints_the_tokens():
    r = _run("generate", "hello", "--max-new-tokens", "6", *TINY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text printed"
    assert "[6 tokens in" in r.stderr and "finish reason: length" in r.stderr, r.stderr


def test_generate_is_deterministic_and_seeded_sampling_too():
    greedy = [_run("generate", "abc", "--max-new-tokens", "5", *TINY).stdout for _ in range(2)]
    assert greedy[0] == greedy[1]
    args = ["generate", "abc", "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "7"]
    sampled = [_run(*args, *TINY, module="flashserve") for _ in range(2)]
    assert sampled[0].returncode == 0, sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout


def test_generate_chat_on_the_default_model():
    r = _run("generate", "--chat", "What is the capital of France?", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["generate", "hi", "--max-new-tokens", "0", *TINY], 2, "max_new_tokens"),
        (["generate", "hi", "--temperature", "-1", *TINY], 2, "temperature"),
        (["generate", "hi", "--max-new-tokens", "many", *TINY], 2, "invalid int value"),
        (["generate", "hi", "--block-size", "3", *TINY], 2, "power of two"),
        (["generate", "hi", "--attention-backend", "magic", *TINY], 2, "invalid choice"),
        (["generate", "hi", "--device", "tpu", *TINY], 2, "device"),
        (["generate", "hi", "--model", "/no/such/model.gguf"], 1, "cannot load the model"),
        (["generate", "", *TINY], 1, "empty"),
        (["generate", "hi", "--max-new-tokens", "5000", *TINY], 1, "context length"),
        (["serve", "--port", "eighty"], 2, "invalid int value"),
        (["serve", "--model", "dummy:no-such-preset"], 1, "cannot load the model"),
        (["launch"], 2, "invalid choice"),
        ([], 2, "required"),
    ],
)
def test_bad_arguments_fail_clearly(args, status, message):
    r = _run(*args)
    assert r.returncode == status, (r.returncode, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_help_lists_the_commands():
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "generate" in top.stdout
    engine_only = _run("--help", module="flashserve")
    assert engine_only.returncode == 0 and "generate" in engine_only.stdout
    assert "serve" not in engine_only.stdout, "the engine package must not know the server"
    serve = _run("serve", "--help")
    for option in ("--host", "--port", "--model", "--max-kv-tokens", "--attention-backend"):
        assert option in serve.stdout


def test_console_script_is_installed():
    script = shutil.which("flashserve", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("flashserve is not installed in this environment (make test installs it)")
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
