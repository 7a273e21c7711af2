"""The engine's own exceptions."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot go on (its CUDA context failed, or a tensor-parallel rank died):
    every request fails, and the process should be restarted."""
