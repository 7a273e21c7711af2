"""Which float8 weights a model gets: from ``config.json``'s ``quantization_config`` (the
checkpoint's own, used with or without ``--quantization``) or from ``--quantization fp8``.

Checkpoints loaded as they are (each projection's ``weight`` F8_E4M3 beside its scale):

- compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes): every
  ``config_groups`` entry has ``weights`` of ``num_bits`` 8, ``type`` float, ``strategy``
  tensor or channel (``weight_scale`` one value or ``[N, 1]``: kept per output row) or block
  with ``block_structure`` [128, 128] (``weight_scale`` ``[cdiv(N, 128), cdiv(K, 128)]``);
- ``quant_method`` fp8 with ``weight_block_size`` [128, 128] (DeepSeek-V3, Qwen3 ``-FP8``:
  ``weight_scale_inv``), or without it (per-tensor ``weight_scale``).

Activations are quantized as they come, per token (and per 128 columns for block weights),
whatever the checkpoint says: a static ``input_scale`` is skipped, not used (per token is at
least as fine as one scale per tensor), as are the KV cache's ``k_scale``/``v_scale`` (an fp8
KV cache computes its own). Anything else in ``quantization_config`` (integer or 4-bit
weights, AWQ, GPTQ, other block sizes, activation schemes finer than per token...) is refused
with one line naming the field and what is supported.
"""

from __future__ import annotations

from typing import Any

from flashserve.config import QUANTIZATIONS
from flashserve.models.linear import BLOCK, CHANNEL, QUANTIZE_AT_LOAD, Fp8Weights

SUPPORTED = (
    "supported: compressed-tensors float8 weights (strategy tensor, channel, or block "
    "[128, 128]) and quant_method fp8 (per tensor, or weight_block_size [128, 128])"
)
_FLOAT_FORMATS = (None, "float-quantized", "naive-quantized")
_BLOCK = [128, 128]


class Unsupported(ValueError):
    """One line: the ``quantization_config`` field, its value, and what is supported."""

    def __init__(self, field: str, value: Any, why: str = ""):
        why = f" ({why})" if why else ""
        super().__init__(f"quantization_config.{field} {value!r} is not supported{why}; "
                         f"{SUPPORTED}")  # fmt: skip


def fp8_weights(config: dict[str, Any], quantization: str | None = None) -> Fp8Weights | None:
    """The float8 layout of a model whose ``config.json`` is ``config``, asked for with
    ``quantization`` (``--quantization``: None or ``fp8``): the checkpoint's when it has a
    ``quantization_config``, else quantize at load for ``fp8``, else None (unquantized).
    ``Unsupported`` (a ValueError) for a ``quantization_config`` we cannot run."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    q = config.get("quantization_config") or config.get("compression_config")
    if not q:
        return QUANTIZE_AT_LOAD if quantization == "fp8" else None
    if not isinstance(q, dict):
        raise Unsupported("", q, "not an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _fp8_method(q)
    raise Unsupported("quant_method", method)


def _compressed_tensors(q: dict[str, Any]) -> Fp8Weights:
    if q.get("format") not in _FLOAT_FORMATS:
        raise Unsupported("format", q.get("format"))
    sparsity = q.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise Unsupported("sparsity_config.format", sparsity.get("format"))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Unsupported("config_groups", groups, "no quantization groups")
    kinds = {}
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise Unsupported(where, group)
        kinds[name] = _weights(group.get("weights"), f"{where}.weights")
        _input_activations(group.get("input_activations"), f"{where}.input_activations",
                           kinds[name])  # fmt: skip
        if group.get("output_activations"):
            raise Unsupported(f"{where}.output_activations", group["output_activations"])
        if group.get("format") not in _FLOAT_FORMATS:
            raise Unsupported(f"{where}.format", group["format"])
    scales = set(kinds.values())
    if len(scales) > 1:
        mix = ", ".join(f"{n}: {k}" for n, k in kinds.items())
        raise Unsupported("config_groups", mix, "block and per-channel/tensor weights mixed")
    scales = scales.pop()
    what = "per-channel or per-tensor" if scales == CHANNEL else "128x128 block"
    return Fp8Weights(scales, "weight_scale", f"compressed-tensors fp8, {what} scales")


def _weights(w: Any, where: str) -> str:
    """CHANNEL or BLOCK for a compressed-tensors ``weights`` scheme; Unsupported otherwise."""
    if not isinstance(w, dict):
        raise Unsupported(where, w, "no weight quantization")
    if w.get("num_bits") != 8:
        raise Unsupported(f"{where}.num_bits", w.get("num_bits"), "8-bit float weights only")
    if w.get("type") != "float":
        raise Unsupported(f"{where}.type", w.get("type"), "8-bit float weights only")
    if w.get("symmetric") is False or w.get("dynamic"):
        raise Unsupported(f"{where}.symmetric/dynamic", f"{w.get('symmetric')}/{w.get('dynamic')}")
    strategy = w.get("strategy")
    if strategy in ("tensor", "channel"):
        return CHANNEL
    if strategy == "block" and list(w.get("block_structure") or []) == _BLOCK:
        return BLOCK
    if strategy == "block":
        raise Unsupported(f"{where}.block_structure", w.get("block_structure"))
    raise Unsupported(f"{where}.strategy", strategy)


def _input_activations(a: Any, where: str, scales: str) -> None:
    """None (weight-only), or float8 per tensor (static: its input_scale is skipped) or per
    token, or per 128-column group with block weights: what our dynamic quantization honours
    or refines. Unsupported otherwise."""
    if not a:
        return
    if not isinstance(a, dict):
        raise Unsupported(where, a)
    why = "activations are quantized to float8 e4m3 per token"
    for key, want in (("num_bits", 8), ("type", "float")):
        if a.get(key) != want:
            raise Unsupported(f"{where}.{key}", a.get(key), why)
    strategy = a.get("strategy")
    group = strategy == "group" and a.get("group_size") == 128 and scales == BLOCK
    if strategy not in ("tensor", "token") and not group:
        raise Unsupported(f"{where}.strategy", strategy, why)


def _fp8_method(q: dict[str, Any]) -> Fp8Weights:
    """``quant_method`` fp8 (transformers' FineGrainedFP8Config, vLLM's Fp8Config)."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise Unsupported("fmt", q.get("fmt"), "e4m3 only")
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise Unsupported("activation_scheme", q.get("activation_scheme"))
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Weights(CHANNEL, "weight_scale", "fp8, per-tensor scales")
    if list(block) != _BLOCK:
        raise Unsupported("weight_block_size", block)
    return Fp8Weights(BLOCK, "weight_scale_inv", "fp8, 128x128 block scales")
