"""Hugging Face model directories: ``config.json`` plus one or more ``*.safetensors`` files.

Every file's header is read and checked (``Checkpoint.open``) before the model is allocated or
any weight copied, so a bad download fails at once, in one line naming the file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from flashserve.loaders.errors import WeightsError
from flashserve.loaders.quantization import fp8_weights
from flashserve.loaders.safetensors_header import TensorInfo, read_header
from flashserve.models.config import ModelConfig
from flashserve.models.linear import Fp8Weights
from flashserve.models.sharding import Shard

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
# a tensor's name, shape and dtype -> the part of it a rank reads
ShardOf = Callable[[str, tuple[int, ...], torch.dtype], Shard]


def read_config(path: Path) -> ModelConfig:
    """``config.json``, with ``generation_config.json``'s EOS ids merged into eos_token_ids."""
    config = ModelConfig.from_hf_dict(_read_json(path / "config.json"), name=path.name)
    gen_file = path / "generation_config.json"
    extra = _read_json(gen_file).get("eos_token_id") if gen_file.exists() else None
    extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
    config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
    return config


def read_fp8_weights(path: Path, quantization: str | None) -> Fp8Weights | None:
    """The float8 layout of the model (``quantization.fp8_weights``): config.json's
    ``quantization_config``, or ``quantization`` (``--quantization``) for an unquantized
    checkpoint. WeightsError naming config.json for a quantization we cannot run."""
    file = path / "config.json"
    try:
        return fp8_weights(_read_json(file), quantization)
    except WeightsError:
        raise
    except ValueError as exc:
        raise WeightsError(file, str(exc)) from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: the shards an index names, or the single file."""
    if (path / INDEX_FILE).exists():
        return sorted(set(read_index(path).values()))
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(
        f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are "
        f"supported); it holds: {found}"
    )


def read_index(path: Path) -> dict[str, Path]:
    """``model.safetensors.index.json``'s weight map: tensor name -> its shard, each shard
    there (WeightsError naming the index or the first missing shard otherwise)."""
    index = path / INDEX_FILE
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(index, "corrupt: no weight_map of tensor names to shard files")
    shards = {name: path / shard for name, shard in weight_map.items()}
    missing = sorted({s for s in shards.values() if not s.is_file()})
    if missing:
        more = f" (and {len(missing) - 1} more shards)" if len(missing) > 1 else ""
        raise WeightsError(missing[0], f"missing: {INDEX_FILE} places tensors in this shard{more}")
    return shards


@dataclass
class Checkpoint:
    """A directory's safetensors files with their headers read and checked (``open``): a
    truncated or corrupt file, a missing shard, a tensor the index places in a shard that
    lacks it, a parameter that is not float (nor float8 e4m3 in a quantized checkpoint:
    ``float8``): each a WeightsError before any data is read."""

    path: Path
    headers: dict[Path, dict[str, TensorInfo]]  # file -> its tensors
    current: Path | None = None  # the file ``weights`` is reading (None before and after)

    @classmethod
    def open(cls, path: Path, float8: bool = False) -> Checkpoint:
        index = read_index(path) if (path / INDEX_FILE).exists() else {}
        files = sorted(set(index.values())) if index else safetensors_files(path)
        headers = {file: read_header(file, float8) for file in files}
        for name, shard in index.items():
            if name not in headers[shard]:
                raise WeightsError(shard, f"lacks tensor {name}, which {INDEX_FILE} places in it")
        return cls(path, headers)

    def weights(self, shard: ShardOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time, as stored (memory-mapped, on the CPU); the caller
        copies each into its parameter, converting device and dtype there. ``shard``: only
        the part of each tensor it names is read (a tensor-parallel rank's)."""
        for file, infos in self.headers.items():
            self.current = file
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        info = infos[name]
                        dtype = _TORCH_DTYPES.get(info.dtype, torch.float32)
                        part = None if shard is None else shard(name, info.shape, dtype)
                        if part is None or (part.dim is None and not part.zeros):
                            yield name, f.get_tensor(name)
                            continue
                        yield name, part.read(f.get_slice(name).__getitem__, info.shape, dtype)
            except SafetensorError as exc:  # changed since ``open`` read it?
                raise WeightsError(file, f"unreadable: {exc}") from exc
        self.current = None


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found")
    try:
        with path.open() as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(path, f"corrupt: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise WeightsError(path, "corrupt: not a JSON object")
    return data
