"""Where Hugging Face checkpoint tensors go in our model: names onto (fused) parameters.

Our q/k/v projections are one Linear and gate/up another. Most checkpoints store them apart
(``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``), each a row slice of ours;
Phi-3's store them fused already (``qkv_proj``, ``gate_up_proj``, in our row order). A
multimodal Gemma 3 checkpoint holds the text model under ``language_model`` (4.x:
``language_model.model.*``, 5.x: ``model.language_model.*``) beside a vision tower we skip.
An fp8 checkpoint holds each projection's scales beside its weight (``q_proj.weight_scale``,
or ``weight_scale_inv``): they go to the same rows of the fused projection, through its
``Linear`` (``flashserve.models.linear``), which knows their layout.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from flashserve.models.config import ModelConfig
from flashserve.models.linear import Linear

# checkpoint tensors that carry no weights of ours: fp8 checkpoints' static activation scales
# (we quantize activations per token as they come)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale")
# Static KV-cache scales of FP8 checkpoints with a kv-cache scheme (one per layer for K and V:
# llm-compressor's ``self_attn.k_scale``/``v_scale``, AutoFP8's ``k_proj.k_scale``/
# ``v_proj.v_scale``, TGI's ``self_attn.kv_scale``). Our fp8 cache computes a scale per token
# and KV head where K/V are written (kernels.kv_quant), which needs no calibration and tracks
# each token's range, so these are accepted and not used.
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
FUSED_CHECKPOINTS = ("phi3",)  # qkv_proj and gate_up_proj stored fused
_MULTIMODAL_RENAMES = (
    ("model.language_model.", "model."),  # transformers 5
    ("language_model.model.", "model."),  # transformers 4
    ("language_model.lm_head.", "lm_head."),
)
_MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.")


class Slot(NamedTuple):
    """Where a checkpoint tensor goes: rows ``[start, start + size)`` of ``param`` (None: all
    of it); for a projection's tensors, the ``Linear`` that loads them and which of its
    tensors it is (``weight``, ``bias``, ``scale``; rows are the weight's even for a scale)."""

    param: nn.Parameter
    start: int = 0
    size: int | None = None
    linear: Linear | None = None
    kind: str = ""


def checkpoint_name(name: str, config: ModelConfig) -> str | None:
    """The name ``load_weights`` knows a checkpoint tensor by; None for one to skip."""
    if name.endswith(_IGNORED_SUFFIXES) or name.endswith(_KV_SCALE_SUFFIXES):
        return None
    if not config.multimodal_checkpoint:
        return name
    if name.removeprefix("model.").startswith(_MULTIMODAL_SKIPPED):
        return None
    for old, new in _MULTIMODAL_RENAMES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def weight_slots(model: nn.Module, config: ModelConfig,
                 scale_name: str | None = None) -> dict[str, Slot]:  # fmt: skip
    """Hugging Face name -> ``Slot``. ``scale_name``: the suffix of the checkpoint's fp8
    weight scales (``weight_scale``, ``weight_scale_inv``); None: it has none."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    slots = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        linear = linears.get(owner)
        if linear is None:
            slots[name] = Slot(p)
        elif leaf != "weight_scale":
            slots[name] = Slot(p, linear=linear, kind=leaf)
        elif scale_name is not None:
            slots[f"{owner}.{scale_name}"] = Slot(p, linear=linear, kind="scale")
    if config.architecture in FUSED_CHECKPOINTS:
        return slots
    c = config
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        qkv = (("q", 0, c.q_size), ("k", c.q_size, c.kv_size), ("v", c.q_size + c.kv_size,
                                                                  c.kv_size))  # fmt: skip
        inter = c.intermediate_size
        _split(slots, f"{pre}self_attn.qkv_proj.", f"{pre}self_attn.{{}}_proj.", qkv)
        _split(slots, f"{pre}mlp.gate_up_proj.", f"{pre}mlp.{{}}_proj.",
               (("gate", 0, inter), ("up", inter, inter)))  # fmt: skip
    return slots


def _split(slots: dict[str, Slot], fused: str, part: str,
           parts: tuple[tuple[str, int, int], ...]) -> None:  # fmt: skip
    """Replace the fused projection's slots (``fused`` + weight, bias, scale) by its parts'
    (``part.format(name)`` + the same), each its rows."""
    for key in [k for k in slots if k.startswith(fused)]:
        slot = slots.pop(key)
        leaf = key.removeprefix(fused)
        for name, start, size in parts:
            slots[part.format(name) + leaf] = slot._replace(start=start, size=size)


def check_complete(missing: list[str], unexpected: list[str]) -> None:
    """ValueError naming (the first few of) the tensors missing and those unexpected."""
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {', '.join(missing[:8])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:8])}")
    raise ValueError("checkpoint does not match the model; " + "; ".join(parts))
