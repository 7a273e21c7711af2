"""The measurement scripts of docs/benchmarks/ as modules, for the tests of their kernels."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def load(name: str):
    """``docs/benchmarks/<name>.py`` imported as the module ``name`` (registered in
    ``sys.modules`` first: a dataclass there looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
