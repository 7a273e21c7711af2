"""The engine's prefill path (``EngineConfig.prefill_path``, ``--prefill-path``): an explicit
hopper or gluon path is refused at start-up, with its reason, wherever its kernel cannot run;
auto (the default) starts anywhere, and the default block size is 128 where the sm_90 paths
can run. The device is stood in for (a capability reported by a patched
``torch.cuda``): these run on the CPU; the kernels' own results are the GPU tests'."""

from __future__ import annotations

import pytest
import torch
import triton

from flashserve.config import EngineConfig
from flashserve.loaders.load import _check_prefill_path
from flashserve.models.presets import preset_config
from kernels.prefill_paths import GLUON_TRITON, gluon_triton_refusal


@pytest.fixture
def sm(monkeypatch):
    """Set the stand-in GPU's compute capability: ``sm((9, 0))``."""

    def set_capability(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return set_capability


def _config(**kwargs) -> EngineConfig:
    return EngineConfig(**{"device": "cuda", "block_size": 128, **kwargs})


@pytest.mark.parametrize("path", ["hopper", "gluon"])
@pytest.mark.parametrize(
    "cap, overrides, words",
    [
        ((9, 0), {"device": "cpu"}, "needs the triton backend on a CUDA GPU"),
        ((9, 0), {"attention_backend": "torch"}, "needs the triton backend on a CUDA GPU"),
        ((8, 0), {}, "needs an sm_90 GPU"),
        ((10, 0), {}, "needs an sm_90 GPU"),
        ((9, 0), {"block_size": 8}, "needs block_size >= "),
    ],
)
def test_an_explicit_path_is_refused_where_its_kernel_cannot_run(sm, path, cap, overrides, words):
    sm(cap)
    with pytest.raises(ValueError, match=f"prefill_path {path} {words}"):
        _config(prefill_path=path, **overrides)


def test_the_page_each_path_needs(sm):
    """Hopper's KV tiles are 64 keys or more, one page's run; Gluon's are cut to the page."""
    sm((9, 0))
    with pytest.raises(ValueError, match="block_size >= 64, got 32"):
        _config(prefill_path="hopper", block_size=32)
    with pytest.raises(ValueError, match="block_size >= 64, got 32"):
        _config(prefill_path="gluon", block_size=32)
    assert _config(prefill_path="hopper", block_size=64).prefill_path == "hopper"


def test_an_fp8_cache_takes_the_hopper_path_not_gluon(sm, monkeypatch):
    """The Hopper path reads e4m3 pages (kernels.prefill); the Gluon kernel does not. fp8
    caches take 128-token blocks by default on sm_90; hopper refuses a smaller one given."""
    sm((9, 0))
    monkeypatch.setattr(triton, "__version__", GLUON_TRITON + "0")
    for block in (64, 128):
        config = _config(prefill_path="hopper", kv_cache_dtype="fp8", block_size=block)
        assert (config.prefill_path, config.kv_cache_dtype, config.block_size) == (
            "hopper", "fp8", block)  # fmt: skip
    with pytest.raises(ValueError, match="prefill_path gluon takes bf16/fp16 KV caches, not fp8"):
        _config(prefill_path="gluon", kv_cache_dtype="fp8")
    config = EngineConfig(device="cuda", prefill_path="hopper", kv_cache_dtype="fp8")
    assert config.block_size == 128
    with pytest.raises(ValueError, match="prefill_path hopper needs block_size >= 64, got 16"):
        EngineConfig(device="cuda", prefill_path="hopper", kv_cache_dtype="fp8", block_size=16)
    assert _config(kv_cache_dtype="fp8").prefill_path == "auto"


def test_gluon_starts_where_it_can_run(sm, monkeypatch):
    sm((9, 0))
    monkeypatch.setattr(triton, "__version__", GLUON_TRITON + "0")
    for dtype in ("bfloat16", "float16"):
        config = _config(prefill_path="gluon", block_size=64, dtype=dtype)
        assert config.prefill_path == "gluon" and config.block_size == 64
    sm((9, 1))  # an sm_9x that is not sm_90: the Hopper path's checks take it, Gluon's not
    assert _config(prefill_path="hopper").prefill_path == "hopper"
    with pytest.raises(ValueError, match="gluon needs an sm_90 GPU"):
        _config(prefill_path="gluon")


def test_gluon_refuses_float32_and_other_tritons(sm, monkeypatch):
    sm((9, 0))
    with pytest.raises(ValueError, match="gluon takes bf16/fp16 models, not float32"):
        _config(prefill_path="gluon", dtype="float32")
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    with pytest.raises(ValueError, match="written for Triton 3.6.x.*this Triton is 3.9.0"):
        _config(prefill_path="gluon")
    assert gluon_triton_refusal(GLUON_TRITON + "1") is None
    assert _config(prefill_path="hopper").prefill_path == "hopper"  # not Triton-bound


@pytest.mark.parametrize(
    "cap, overrides, block",
    [
        ((9, 0), {}, 128),
        ((9, 0), {"prefill_path": "hopper"}, 128),
        ((9, 0), {"dtype": "float16"}, 128),
        ((9, 0), {"prefill_path": "portable"}, 16),
        ((9, 0), {"kv_cache_dtype": "fp8"}, 128),  # a head's rows of a page together
        ((9, 0), {"kv_cache_dtype": "fp8", "prefill_path": "portable"}, 128),
        ((8, 9), {"kv_cache_dtype": "fp8"}, 16),  # Ada reads e4m3 too: token rows
        ((9, 0), {"dtype": "float32"}, 16),  # so do float32 ones
        ((9, 0), {"attention_backend": "torch"}, 16),
        ((9, 0), {"device": "cpu"}, 16),
        ((8, 0), {}, 16),
        ((10, 0), {}, 16),
        ((9, 0), {"block_size": 32}, 32),  # given: kept, and auto runs the portable kernel
    ],
)
def test_the_default_block_size_follows_the_prefill_path(sm, cap, overrides, block):
    """128-token blocks where the sm_90 prefill paths can run (their tiles are a page's run of
    >= 64 keys) and for fp8 caches on sm_90 (stored head-major), 16 elsewhere; a given size is
    kept."""
    sm(cap)
    config = EngineConfig(**{"device": "cuda", **overrides})
    assert config.block_size == block
    assert config.prefill_path == overrides.get("prefill_path", "auto")


@pytest.mark.parametrize("path", ["portable", "auto"])
def test_portable_and_auto_start_anywhere(sm, path):
    sm((8, 0))
    assert _config(prefill_path=path, block_size=16).prefill_path == path
    assert EngineConfig(device="cpu", prefill_path=path).prefill_path == path


@pytest.mark.parametrize(
    "preset, path, words",
    [
        ("llama3.1-8b", "hopper", None),
        ("llama3.1-8b", "gluon", None),
        ("qwen3-8b", "gluon", None),
        ("gemma3-12b", "hopper", None),  # the Hopper path takes windows and soft-caps
        ("gemma3-12b", "gluon", "no sliding windows or attention soft-capping"),
        ("mistral-7b-v0.1", "gluon", "no sliding windows"),
    ],
)
def test_the_model_is_checked_at_load(preset, path, words):
    config = preset_config(preset)
    if words is None:
        _check_prefill_path(path, config)
    else:
        with pytest.raises(ValueError, match=words):
            _check_prefill_path(path, config)


@pytest.mark.parametrize("path", ["hopper", "gluon"])
def test_a_head_dim_the_kernels_lack_is_refused(path):
    import dataclasses

    config = dataclasses.replace(preset_config("tiny"), head_dim=96)
    with pytest.raises(ValueError, match=f"prefill_path {path} takes head dims .* is 96"):
        _check_prefill_path(path, config)
    _check_prefill_path("portable", config)


def test_a_gpu_that_does_not_exist_is_named(sm, monkeypatch):
    """The default block size asks the device for its capability: a device index past torch's
    count, or a malformed name, is refused first, in one line."""
    sm((9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="device cuda:2 does not exist: torch sees 2 GPU"):
        EngineConfig(device="cuda:2")
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'cuda:x'"):
        EngineConfig(device="cuda:x")
    assert EngineConfig(device="cuda:1").block_size == 128
