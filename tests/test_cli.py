"""The command line: as users run it (``python -m``, the console script) where that matters,
in-process (``main(argv)``, faster) for the many argument checks."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "dummy:tiny"]


def _run(*args: str, module: str = "server", timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_generate_prints_the_tokens():
    r = _run("generate", "hello", "--max-new-tokens", "6", *TINY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text printed"
    assert "[6 tokens in" in r.stderr and "finish reason: length" in r.stderr, r.stderr


def test_generate_is_deterministic_and_seeded_sampling_too(capsys):
    greedy = [_main(capsys, "generate", "abc", "--max-new-tokens", "5", *TINY) for _ in range(2)]
    assert greedy[0][0] == 0 and greedy[0][1] == greedy[1][1]
    args = ["generate", "abc", "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "7"]
    sampled = [_main(capsys, *args, *TINY) for _ in range(2)]
    assert sampled[0][0] == 0, sampled[0][2]
    assert sampled[0][1] == sampled[1][1]


def test_python_m_flashserve_generates():
    r = _run("generate", "abc", "--max-new-tokens", "3", *TINY, module="flashserve")
    assert r.returncode == 0 and "[3 tokens in" in r.stderr, r.stderr


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
        (["generate", "hi", "--device", "cpu", "--pdl-chain", *TINY], 2, "pdl_chain needs"),
        (["generate", "hi", "--prefill-path", "fast", *TINY], 2, "invalid choice"),
        (
            ["generate", "hi", "--max-kv-tokens", "64", "--kv-cache-memory-bytes", "9999", *TINY],
            2,
            "max_kv_tokens or kv_cache_memory_bytes, not both",
        ),
        (["generate", "hi", "--kv-cache-memory-bytes", "0", *TINY], 2, "must be >= 1, got 0"),
        (["generate", "hi", "--kv-cache-memory-bytes", "100", *TINY], 1, "holds no KV block"),
        (
            ["generate", "hi", "--device", "cpu", "--prefill-path", "hopper", *TINY],
            2,
            "prefill_path hopper needs the triton backend on a CUDA GPU",
        ),
        (["generate", "hi", "--model", "/no/such/model.gguf"], 1, "cannot load the model"),
        (["generate", "", *TINY], 1, "empty"),
        (["generate", "--chat", "hi", *TINY], 1, "no chat template"),
        (["generate", "hi", "--max-new-tokens", "5000", *TINY], 1, "context length"),
        (["serve", "--port", "eighty"], 2, "invalid int value"),
        (["serve", "--model", "dummy:no-such-preset"], 1, "cannot load the model"),
        (["launch"], 2, "invalid choice"),
        ([], 2, "required"),
    ],
)
def test_bad_arguments_fail_clearly(capsys, args, status, message):
    got, _, err = _main(capsys, *args)
    assert got == status, (got, err)
    assert message in err, err
    assert "Traceback" not in err, err


def test_generate_prompt_that_is_not_utf8_is_one_line_and_exit_2():
    """argv bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer
    refuses with a TypeError: the prompt is refused first, in one line."""
    cmd = [sys.executable, "-m", "flashserve", "generate", b"caf\xe9", *TINY]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=180)
    err = r.stderr.decode(errors="replace").strip()
    assert r.returncode == 2, err
    assert err.startswith("flashserve generate: error: the prompt") and "\n" not in err, err
    assert "U+DCE9 at character 3" in err


def test_help_lists_the_commands(capsys):
    status, out, _ = _main(capsys, "--help")
    assert status == 0 and _lists_command(out, "serve") and _lists_command(out, "generate")
    engine_only = _run("--help", module="flashserve")
    assert engine_only.returncode == 0 and _lists_command(engine_only.stdout, "generate")
    assert not _lists_command(engine_only.stdout, "serve"), "the engine must not know the server"
    status, out, _ = _main(capsys, "serve", "--help")
    for option in ("--host", "--port", "--model", "--max-kv-tokens", "--attention-backend"):
        assert option in out


def _lists_command(help_text: str, name: str) -> bool:
    return re.search(rf"^\s+{name}\s", help_text, re.MULTILINE) is not None


def test_console_script_is_installed():
    script = shutil.which("flashserve", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("flashserve is not installed in this environment (make test installs it)")
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


@pytest.mark.parametrize(
    "flag, device, expected",
    [([], "cpu", False), (["--async-scheduling"], "cpu", True),
     (["--no-async-scheduling"], "cpu", False)],
)  # fmt: skip
def test_async_scheduling_flag_and_its_default(flag, device, expected):
    """On by default only on CUDA (on the CPU a step runs at once); the flag turns it on or off."""
    from flashserve.cli.args import engine_config_from_args
    from flashserve.cli.main import build_parser

    args = build_parser().parse_args(["generate", "hi", *TINY, "--device", device, *flag])
    assert engine_config_from_args(args).async_scheduling is expected


@pytest.mark.parametrize(
    "flag, expected",
    [([], False), (["--attention-backend", "triton"], True),
     (["--attention-backend", "triton", "--no-pdl-chain"], False), (["--no-pdl-chain"], False)],
)  # fmt: skip
def test_pdl_chain_flag_and_its_default(flag, expected):
    """On by default with the triton backend (the kernels join only on sm_90+); the flag
    turns it off (on the torch backend, asking for it is an error: see the bad arguments)."""
    from flashserve.cli.args import engine_config_from_args
    from flashserve.cli.main import build_parser

    args = build_parser().parse_args(["generate", "hi", *TINY, "--device", "cpu", *flag])
    assert engine_config_from_args(args).pdl_chain is expected


@pytest.mark.parametrize(
    "flag, expected", [([], "auto"), (["--prefill-path", "portable"], "portable")]
)
def test_prefill_path_flag_and_its_default(flag, expected):
    """Auto by default, accepted anywhere (it falls back to the portable kernel where the
    sm_90 ones cannot run)."""
    from flashserve.cli.args import engine_config_from_args
    from flashserve.cli.main import build_parser

    args = build_parser().parse_args(["generate", "hi", *TINY, "--device", "cpu", *flag])
    assert engine_config_from_args(args).prefill_path == expected
