"""A bad Hugging Face checkpoint fails in one line that names the file and the problem, exit
status 1, no traceback, in ``flashserve generate`` and ``flashserve serve`` alike.

Each case writes a tiny Llama checkpoint with transformers' own ``save_pretrained`` (one file,
or three shards with an index) and breaks it as downloads and copies break: cut short (in the
header's length, in the header, in the data), overwritten bytes, bytes appended, a shard or a
tensor missing, a tensor of the wrong shape, an integer or float8 tensor where a weight goes.
The header checks themselves (``flashserve.loaders.safetensors_header``) also meet files no
library writes: overlapping tensors, gaps, entries that are not tensors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from model_utils import TINY
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from flashserve.loaders.errors import WeightsError
from flashserve.loaders.load import load_model
from flashserve.loaders.safetensors_header import read_header

ROOT = Path(__file__).resolve().parents[1]
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD1, SHARD2 = "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"
UP = "model.layers.1.mlp.up_proj.weight"


def save_tiny(path: Path, shard: str | None = None) -> None:
    """A tiny random Llama as ``save_pretrained`` writes it, and a word-level tokenizer."""
    config = transformers.LlamaConfig(**TINY)
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size=shard or "50GB")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')


def _cut(file: Path, size: int) -> None:
    os.truncate(file, size if size >= 0 else file.stat().st_size + size)


def _overwrite(file: Path, at: int, data: bytes) -> None:
    with file.open("r+b") as f:
        f.seek(at)
        f.write(data)


def _append(file: Path, data: bytes) -> None:
    with file.open("ab") as f:
        f.write(data)


def _retype(file: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    state = load_file(file)
    state[name] = fn(state[name])
    save_file(state, file, metadata={"format": "pt"})


def _drop(file: Path, name: str) -> None:
    state = load_file(file)
    del state[name]
    save_file(state, file, metadata={"format": "pt"})


def _unindexed_tensor(path: Path) -> None:
    """The index places the up projection in shard 1, which does not hold it."""
    index = json.loads((path / INDEX).read_text())
    shard = index["weight_map"][UP]
    other = SHARD2 if shard == SHARD1 else SHARD1
    index["weight_map"][UP] = other
    (path / INDEX).write_text(json.dumps(index))


# name: (sharded?, break the checkpoint, the file the message names, the problem it states)
CASES = {
    "truncated-data": (False, lambda p: _cut(p / SINGLE, -1000), SINGLE,
                       r"truncated: the header describes \d+ bytes of tensor data, the file "
                       r"holds \d+"),
    "truncated-header": (False, lambda p: _cut(p / SINGLE, 100), SINGLE,
                         r"truncated: the header alone is \d+ bytes, the file has 92"),
    "truncated-length": (False, lambda p: _cut(p / SINGLE, 5), SINGLE,
                         "truncated: 5 bytes, too short"),
    "empty-file": (False, lambda p: _cut(p / SINGLE, 0), SINGLE, "truncated: 0 bytes"),
    "header-overwritten": (False, lambda p: _overwrite(p / SINGLE, 9, b"\xff\x00garbage"),
                           SINGLE, "corrupt: its header is not valid JSON"),
    "not-safetensors": (False, lambda p: _overwrite(p / SINGLE, 0, b"PK\x03\x04\x14\x00\x00\x00"),
                        SINGLE, "not a safetensors file"),
    "bytes-appended": (False, lambda p: _append(p / SINGLE, b"\0" * 64), SINGLE,
                       "corrupt: 64 bytes after the last tensor"),
    "shard-missing": (True, lambda p: (p / SHARD2).unlink(), SHARD2,
                      f"missing: {re.escape(INDEX)} places tensors in this shard"),
    "shard-truncated": (True, lambda p: _cut(p / SHARD2, -8), SHARD2, "truncated"),
    "index-names-absent-tensor": (True, _unindexed_tensor, "model-0000", f"lacks tensor {UP}"),
    "index-not-json": (True, lambda p: (p / INDEX).write_text("{'weight_map':"), INDEX,
                       "corrupt: not valid JSON"),
    "wrong-shape": (False, lambda p: _retype(p / SINGLE, UP, lambda t: t[:, :-1].contiguous()),
                    SINGLE, rf"tensor {re.escape(UP)}: checkpoint shape \(128, 63\), model "
                            r"expects \(128, 64\)"),
    "integer-weight": (False, lambda p: _retype(p / SINGLE, UP, lambda t: t.to(torch.int32)),
                       SINGLE, f"tensor {re.escape(UP)} is I32: integer weights"),
    "float8-weight": (False, lambda p: _retype(p / SINGLE, UP,
                                               lambda t: t.to(torch.float8_e4m3fn)),
                      SINGLE, f"tensor {re.escape(UP)} is F8_E4M3: float8 weights"),
    "tensor-missing": (False, lambda p: _drop(p / SINGLE, UP), "",
                       f"checkpoint does not match the model; 1 missing: {re.escape(UP)}"),
}  # fmt: skip


@pytest.fixture
def broken(request, tmp_path) -> tuple[Path, str, str]:
    """A checkpoint broken as ``CASES[request.param]`` says: its directory, the path its error
    must name, the problem (a regex)."""
    sharded, breaks, file, problem = CASES[request.param]
    save_tiny(tmp_path, shard="200KB" if sharded else None)
    assert (tmp_path / INDEX).exists() == sharded and (not sharded or (tmp_path / SHARD2).exists())
    breaks(tmp_path)
    return tmp_path, str(tmp_path / file), problem


def _run(*args: str, module: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _the_error_line(r: subprocess.CompletedProcess, command: str) -> str:
    """Exit status 1, no traceback, and one line on stderr besides log records."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"flashserve {command}: error: cannot load the model"), lines[0]
    return lines[0]


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_generate_names_the_file_and_the_problem(broken):
    path, file, problem = broken
    line = _the_error_line(_run("generate", "w5 w6", "--model", str(path),
                                module="flashserve"), "generate")  # fmt: skip
    assert f": {file}" in line and re.search(problem, line), line


@pytest.mark.parametrize("broken", ["truncated-data", "shard-missing", "wrong-shape"],
                         indirect=True)  # fmt: skip
def test_serve_names_the_file_and_the_problem(broken):
    """The engine core process loads the model and sends the error's text to the front end,
    which prints it as ``generate`` does (a shape is checked as the weights are copied, in
    that process)."""
    path, file, problem = broken
    line = _the_error_line(_run("serve", "--model", str(path), "--port", "0", module="server"),
                           "serve")  # fmt: skip
    assert f": {file}" in line and re.search(problem, line), line


@pytest.mark.parametrize("broken", ["truncated-data", "wrong-shape", "index-names-absent-tensor"],
                         indirect=True)  # fmt: skip
def test_load_model_raises_weights_error(broken):
    """In Python the error is a ``WeightsError`` (a ValueError) with the file and the problem
    apart; the header problems are found before the model is allocated."""
    path, file, problem = broken
    with pytest.raises(WeightsError) as info:
        load_model(str(path), "cpu", torch.float32, "torch")
    assert str(info.value.file).startswith(file) and re.search(problem, info.value.problem)


def test_a_good_checkpoint_still_loads(tmp_path):
    save_tiny(tmp_path, shard="200KB")
    loaded = load_model(str(tmp_path), "cpu", torch.float32, "torch")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)


# ---- headers no library writes ---------------------------------------------------------------


def _write(path: Path, header: object, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HEADERS = {
    "overlap": ({"a": F32_2, "b": {**F32_2, "data_offsets": [4, 12]}}, 12,
                "corrupt: tensors a and b overlap"),
    "gap": ({"a": F32_2, "b": {**F32_2, "data_offsets": [12, 20]}}, 20,
            "corrupt: 4 bytes before tensor b belong to none"),
    "size": ({"a": {**F32_2, "shape": [3]}}, 8,
             r"corrupt: the header gives tensor a 8 bytes; F32 \[3\] takes 12"),
    "not-a-tensor": ({"a": {"dtype": "F32", "shape": "2"}}, 0,
                     "corrupt: the header's entry for 'a' is not a tensor"),
    "negative": ({"a": {**F32_2, "data_offsets": [8, 0]}}, 8, "is not a tensor"),
    "list": ([1, 2], 0, "corrupt: its header is not a JSON object"),
    "unknown-dtype": ({"a.weight": {**F32_2, "dtype": "Q4"}}, 8,
                      "tensor a.weight is Q4: this dtype is not supported"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HEADERS))
def test_read_header_refuses(tmp_path, case):
    header, data, problem = HEADERS[case]
    file = _write(tmp_path / "x.safetensors", header, b"\0" * data)
    with pytest.raises(WeightsError, match=problem) as info:
        read_header(file)
    assert info.value.file == file and str(info.value).startswith(f"{file}: ")


def test_read_header_takes_buffers_of_any_dtype_and_empty_tensors(tmp_path):
    """Only parameters (``*.weight``, ``*.bias``) must be float: a checkpoint may hold int64
    position ids the model skips."""
    pos_ids = {**F32_2, "dtype": "I64", "data_offsets": [0, 16]}
    empty = {"dtype": "BF16", "shape": [0, 4], "data_offsets": [16, 16]}
    header = {"__metadata__": {"format": "pt"}, "pos_ids": pos_ids, "e.weight": empty,
              "w.weight": {**F32_2, "data_offsets": [16, 24]}}  # fmt: skip
    tensors = read_header(_write(tmp_path / "x.safetensors", header, b"\0" * 24))
    assert {n: (t.dtype, t.shape) for n, t in tensors.items()} == {
        "pos_ids": ("I64", (2,)),
        "e.weight": ("BF16", (0, 4)),
        "w.weight": ("F32", (2,)),
    }
