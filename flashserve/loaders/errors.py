"""The loaders' error for a weights file that cannot be used."""

from __future__ import annotations

from pathlib import Path


class WeightsError(ValueError):
    """A file of a checkpoint (weights, their index, the config, the tokenizer's files, a GGUF
    file) that is missing, truncated, corrupt, or holds tensors the model cannot take. ``str()``
    is one line, the file first, then the problem.

    A ValueError, so the command line reports it as it reports any model that cannot be
    loaded, in one line with exit status 1 (``flashserve.cli.args.load_engine``; in ``serve``
    the engine core sends its text to the front end, which does the same)."""

    def __init__(self, file: Path | str, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file = Path(file)
        self.problem = problem
