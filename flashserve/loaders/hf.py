"""Hugging Face model directories: ``config.json`` plus one or more ``*.safetensors`` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flashserve.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(path: Path) -> ModelConfig:
    """``config.json``, with ``generation_config.json``'s EOS ids merged into eos_token_ids."""
    config = ModelConfig.from_hf_dict(_read_json(path / "config.json"), name=path.name)
    gen_file = path / "generation_config.json"
    extra = _read_json(gen_file).get("eos_token_id") if gen_file.exists() else None
    extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
    config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
    return config


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: the shards an index names, or the single file."""
    if (path / INDEX_FILE).exists():
        shards = sorted(set(_read_json(path / INDEX_FILE)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise FileNotFoundError(f"{path / INDEX_FILE} names shards that are absent: {missing}")
        return [path / s for s in shards]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(
        f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are "
        f"supported); it holds: {found}"
    )


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time, as stored (memory-mapped, on the CPU);
    the caller copies each into its parameter, converting device and dtype there."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found")
    with path.open() as f:
        return json.load(f)
