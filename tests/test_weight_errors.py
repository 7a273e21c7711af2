"""A bad Hugging Face checkpoint fails in one line that names the file and the problem, exit
status 1, no traceback, in ``flashserve generate`` and ``flashserve serve`` alike.

Each case writes a tiny Llama checkpoint with transformers' own ``save_pretrained`` (one file,
or three shards with an index) and breaks it as downloads and copies break: cut short (in the
header's length, in the header, in the data), overwritten bytes, bytes appended, a shard or a
tensor missing, a tensor of the wrong shape, an integer or float8 tensor where a weight goes.
The header checks themselves (``flashserve.loaders.safetensors_header``) also meet files no
library writes: overlapping tensors, gaps, entries that are not tensors. A broken
``tokenizer.json`` or ``tokenizer_config.json`` fails the same way.

GGUF files (``flashserve.loaders.gguf_header``): a tiny Llama written as llama.cpp's converter
writes it (``gguf_writer``), then cut short (in the fixed header, the metadata, the tensor
infos, the data), overwritten (magic, version, a tensor's type or data offset, a token id,
a key's name) or written with a tensor of the wrong shape. Every case is loaded in-process;
a few also through ``generate`` and ``serve``, whose one-line path is the same for any
``WeightsError`` (the safetensors cases above run it for each kind of problem).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from gguf_writer import BOS, EOS, Q, write_gguf
from model_utils import TINY
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from flashserve.cli.main import main
from flashserve.loaders.errors import WeightsError
from flashserve.loaders.gguf import open_file as open_gguf
from flashserve.loaders.gguf_header import read_header as read_gguf_header
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


def _half(file: Path) -> None:
    _cut(file, file.stat().st_size // 2)


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
    "tokenizer-truncated": (False, lambda p: _half(p / "tokenizer.json"), "tokenizer.json",
                            r"unreadable by tokenizers [\d.]+: EOF while parsing .* \(cut short, "
                            r"or from a newer version\?\)"),
    "tokenizer-not-a-tokenizer": (False, lambda p: (p / "tokenizer.json").write_text(
                                      '{"model": {"type": "Unigramm"}}'), "tokenizer.json",
                                  "unreadable by tokenizers .*: data did not match"),
    "tokenizer-config-not-json": (False, lambda p: (p / "tokenizer_config.json").write_text(
                                      "{'bos_token': '<s>'"), "tokenizer_config.json",
                                  "corrupt: not valid JSON"),
    "tokenizer-config-a-list": (False, lambda p: (p / "tokenizer_config.json").write_text("[]"),
                                "tokenizer_config.json", "corrupt: not a JSON object$"),
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


def _generate(capsys, *args: str, own_process: bool) -> subprocess.CompletedProcess:
    """``flashserve generate ARGS``: in a process of its own (the exit status and stderr a
    shell sees), or through the command line's ``main`` in this process (the same code, less a
    Python start and a torch import; an exception it lets out fails the test as a traceback
    would)."""
    if own_process:
        return _run("generate", *args, module="flashserve")
    capsys.readouterr()
    status = main(["generate", *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["generate", *args], status, captured.out, captured.err)


# the cases whose ``generate`` also runs in a process of its own: one of each way a load fails
# (a header, a shard, a copied tensor, the tokenizer); the others run ``main`` here
OWN_PROCESS = {"truncated-data", "shard-missing", "wrong-shape", "tokenizer-truncated",
               "cut-in-data"}  # fmt: skip


def _the_error_line(r: subprocess.CompletedProcess, command: str) -> str:
    """Exit status 1, no traceback, and one line on stderr besides log records."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"flashserve {command}: error: cannot load the model"), lines[0]
    return lines[0]


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_generate_names_the_file_and_the_problem(broken, capsys, request):
    path, file, problem = broken
    own = request.node.callspec.params["broken"] in OWN_PROCESS
    line = _the_error_line(_generate(capsys, "w5 w6", "--model", str(path), own_process=own),
                           "generate")  # fmt: skip
    assert f": {file}" in line and re.search(problem, line), line
    assert line.count(str(path)) == 1, f"the path said twice: {line}"


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


@pytest.mark.parametrize("broken", ["truncated-data", "wrong-shape", "index-names-absent-tensor",
                                    "tokenizer-truncated"], indirect=True)  # fmt: skip
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


# ---- GGUF files ------------------------------------------------------------------------------

GGUF = "tiny.gguf"
TOKENS, BOS_ID = "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id"
RENAMED_TOKENS = b"tokenizer.ggml.tokenz"  # as long as the key it overwrites
Q_PROJ, K_PROJ, NORM = "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight"
HF_UP, HF_Q = "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"


def save_tiny_gguf(path: Path, change: Callable | None = None) -> Path:
    """A tiny random Llama as llama.cpp's converter writes it (Q8_0 matrices, F32 norms, an
    untied output, a 512-token byte-level vocabulary); ``change`` edits the model first."""
    config = transformers.LlamaConfig(**TINY, bos_token_id=BOS, eos_token_id=EOS)
    hf = transformers.LlamaForCausalLM(config)
    if change is not None:
        change(hf)
    write_gguf(path / GGUF, hf, Q.Q8_0)
    return path / GGUF


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def _kv_at(file: Path, key: str) -> int:
    """Where ``key``'s key/value starts (its key's length), found by the gguf package."""
    return gguf.GGUFReader(file).fields[key].offset


def _value_at(file: Path, key: str) -> int:
    return _kv_at(file, key) + 8 + len(key.encode()) + 4  # after the key and the value type


def _info(file: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s info starts, and where its ggml type is within it."""
    t = next(t for t in gguf.GGUFReader(file).tensors if t.name == name)
    return t.field.offset, t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)


def _shift_data(file: Path, name: str, by: int) -> None:
    at = _info(file, name)[1] + 4
    with file.open("r+b") as f:
        f.seek(at)
        offset = int.from_bytes(f.read(8), "little")
        f.seek(at)
        f.write((offset + by).to_bytes(8, "little"))


def _trim_rows(module_path: str, rows: int) -> Callable:
    def change(hf) -> None:
        module = hf.get_submodule(module_path)
        module.weight = torch.nn.Parameter(module.weight.data[:rows].clone())

    return change


# name: (change the model before writing, break the file, the problem it states)
GGUF_CASES = {
    "empty": (None, lambda f: _cut(f, 0), "truncated: 0 bytes, too short for a GGUF file"),
    "cut-in-prefix": (None, lambda f: _cut(f, 20),
                      "truncated: 20 bytes, too short for a GGUF file"),
    "cut-in-metadata": (None, lambda f: _cut(f, _kv_at(f, TOKENS) + 100),
                        rf"truncated: the file ends in its metadata \(key/value \d+ of \d+, "
                        rf"{re.escape(TOKENS)}\) at \d+ bytes"),
    "cut-in-tensor-infos": (None, lambda f: _cut(f, _info(f, K_PROJ)[1] - 4),
                            rf"truncated: the file ends in its tensor infos \(tensor 3 of 21, "
                            rf"{re.escape(K_PROJ)}\)"),
    "cut-in-data": (None, lambda f: _cut(f, -1000),
                    r"truncated: the tensor infos describe \d+ bytes of tensor data, the file "
                    r"holds \d+ \(tensor output\.weight is the first cut short\)"),
    "not-gguf": (None, lambda f: _overwrite(f, 0, b"PK\x03\x04"),
                 r"not a GGUF file: it starts with b'PK\\x03\\x04', not b'GGUF'"),
    "version": (None, lambda f: _overwrite(f, 4, _u32(7)),
                r"GGUF version 7 is not supported \(2 and 3 are\)"),
    "big-endian": (None, lambda f: _overwrite(f, 4, (3).to_bytes(4, "big")),
                   "a big-endian GGUF file: only little-endian ones are supported"),
    "unknown-type": (None, lambda f: _overwrite(f, _info(f, Q_PROJ)[1], _u32(99)),
                     rf"tensor {re.escape(Q_PROJ)} has ggml type 99, unknown to the gguf package"),
    # I32 takes the bytes F32 did: only the type is wrong
    "unreadable-type": (None, lambda f: _overwrite(f, _info(f, NORM)[1], _u32(Q.I32)),
                        rf"tensor {re.escape(NORM)} is I32: a type we cannot read \(readable: "
                        r"F32, F16, Q4_0, .*BF16"),
    "data-offset": (None, lambda f: _shift_data(f, K_PROJ, 32),
                    rf"corrupt: tensor {re.escape(K_PROJ)}'s data is at offset \d+; the tensors "
                    r"before it end at \d+"),
    "no-vocabulary": (None, lambda f: _overwrite(f, _kv_at(f, TOKENS) + 8, RENAMED_TOKENS),
                      r"GGUF has no vocabulary \(tokenizer\.ggml\.tokens\)"),
    "bos-outside-vocabulary": (None, lambda f: _overwrite(f, _value_at(f, BOS_ID), _u32(9999)),
                               rf"GGUF {re.escape(BOS_ID)} 9999 is not among its 512 tokens"),
    "wrong-shape": (_trim_rows("model.layers.1.mlp.up_proj", 96), None,
                    rf"tensor {re.escape(HF_UP)}: checkpoint shape \(96, 64\), model expects "
                    r"\(128, 64\)"),
    # rows that do not split into the heads to un-permute: the same message, no reshape error
    "wrong-qk-rows": (_trim_rows("model.layers.0.self_attn.q_proj", 40), None,
                      rf"tensor {re.escape(HF_Q)}: checkpoint shape \(40, 64\), model expects "
                      r"\(64, 64\)"),
}  # fmt: skip


@pytest.fixture
def broken_gguf(request, tmp_path) -> tuple[Path, str]:
    """A GGUF file broken as ``GGUF_CASES[request.param]`` says, and the problem (a regex)."""
    change, breaks, problem = GGUF_CASES[request.param]
    file = save_tiny_gguf(tmp_path, change)
    if breaks is not None:
        breaks(file)
    return file, problem


@pytest.mark.parametrize("broken_gguf", list(GGUF_CASES), indirect=True)
def test_load_model_names_the_gguf_file_and_the_problem(broken_gguf):
    file, problem = broken_gguf
    with pytest.raises(WeightsError) as info:
        load_model(str(file), "cpu", torch.float32, "torch")
    assert info.value.file == file and re.search(problem, info.value.problem), info.value
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("broken_gguf", ["cut-in-metadata", "cut-in-data", "not-gguf",
                                         "unreadable-type", "wrong-shape"],
                         indirect=True)  # fmt: skip
def test_generate_names_the_gguf_file_and_the_problem(broken_gguf, capsys, request):
    file, problem = broken_gguf
    own = request.node.callspec.params["broken_gguf"] in OWN_PROCESS
    line = _the_error_line(_generate(capsys, "hi", "--model", str(file), own_process=own),
                           "generate")  # fmt: skip
    assert f": {file}: " in line and re.search(problem, line), line


@pytest.mark.parametrize("broken_gguf", ["cut-in-tensor-infos", "wrong-qk-rows"], indirect=True)
def test_serve_names_the_gguf_file_and_the_problem(broken_gguf):
    file, problem = broken_gguf
    line = _the_error_line(_run("serve", "--model", str(file), "--port", "0", module="server"),
                           "serve")  # fmt: skip
    assert f": {file}: " in line and re.search(problem, line), line


def test_the_unbroken_gguf_file_loads(tmp_path):
    """What the cases break is all that is wrong with them: the file as written loads, and its
    header agrees with the gguf package's reader."""
    file = save_tiny_gguf(tmp_path)
    header = read_gguf_header(file)
    reader = gguf.GGUFReader(file)
    assert [(t.name, t.type, t.shape, t.offset + header.data_offset) for t in header.tensors] == [
        (t.name, t.tensor_type, tuple(map(int, t.shape)), t.data_offset) for t in reader.tensors
    ]
    assert header.metadata == {k: f.contents() for k, f in reader.fields.items()
                               if not k.startswith("GGUF.")}  # fmt: skip
    mapped = open_gguf(file)  # the loader's own view of each tensor's bytes
    for ours, theirs in zip(mapped.tensors, reader.tensors, strict=True):
        assert mapped.raw(ours).tobytes() == theirs.data.tobytes(), ours.name
    load_model(str(file), "cpu", torch.float32, "torch")


# headers no writer writes: (break the file, the problem)
GGUF_HEADERS = {
    "too-many-keys": (lambda f: _overwrite(f, 16, (1 << 40).to_bytes(8, "little")),
                      r"corrupt: its header counts 1099511627776 key/values in a file of \d+ "
                      "bytes"),
    "unknown-value-type": (lambda f: _overwrite(f, _value_at(f, BOS_ID) - 4, _u32(77)),
                           rf"corrupt: metadata key {re.escape(BOS_ID)} has unknown value type 77"),
    "five-dimensions": (lambda f: _overwrite(f, _info(f, K_PROJ)[1] - 20, _u32(5)),
                        rf"corrupt: tensor {re.escape(K_PROJ)} has 5 dimensions \(at most 4\)"),
    "two-tensors-one-name": (lambda f: _overwrite(f, _info(f, K_PROJ)[0] + 8, Q_PROJ.encode()),
                             rf"corrupt: two tensors are named {re.escape(Q_PROJ)}"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GGUF_HEADERS))
def test_read_gguf_header_refuses(tmp_path, case):
    breaks, problem = GGUF_HEADERS[case]
    file = save_tiny_gguf(tmp_path)
    breaks(file)
    with pytest.raises(WeightsError, match=problem) as info:
        read_gguf_header(file)
    assert info.value.file == file and str(info.value).startswith(f"{file}: ")
