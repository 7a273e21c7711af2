"""The compile reports of ``tests/sm90_compile.py`` for tests: the script runs in a process of
its own (it drops ``TRITON_INTERPRET``, which the calling test process needs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def sm90_reports(*prefixes: str) -> dict[str, dict]:
    """{variant: summary} for the variants whose names start with one of ``prefixes``; the
    test skips where Triton has no bundled ptxas to compile for sm_90 with."""
    triton = pytest.importorskip("triton", reason="triton is not importable on this machine")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default Triton 3.9 warns it will change
    run = subprocess.run([sys.executable, str(SCRIPT), *prefixes], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in rows}
