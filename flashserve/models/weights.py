"""Where Hugging Face checkpoint tensors go in our model: names onto (fused) parameters.

Our q/k/v projections are one Linear and gate/up another. Most checkpoints store them apart
(``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``), each a row slice of ours;
Phi-3's store them fused already (``qkv_proj``, ``gate_up_proj``, in our row order). A
multimodal Gemma 3 checkpoint holds the text model under ``language_model`` (4.x:
``language_model.model.*``, 5.x: ``model.language_model.*``) beside a vision tower we skip.
"""

from __future__ import annotations

from torch import nn

from flashserve.models.config import ModelConfig

# checkpoint tensors that carry no weights of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
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

Slot = tuple[nn.Parameter, int, "int | None"]  # parameter, first row, rows (None: all)


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


def weight_slots(model: nn.Module, config: ModelConfig) -> dict[str, Slot]:
    """Hugging Face name -> (our parameter, first row, rows or None for all of it)."""
    slots = {name: (p, 0, None) for name, p in model.named_parameters()}
    if config.architecture in FUSED_CHECKPOINTS:
        return slots
    c = config
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        for kind in ("weight", "bias") if c.attention_bias else ("weight",):
            del slots[f"{pre}self_attn.qkv_proj.{kind}"]
            param = getattr(attn, kind)
            starts = (0, c.q_size, c.q_size + c.kv_size)
            sizes = (c.q_size, c.kv_size, c.kv_size)
            for proj, start, size in zip("qkv", starts, sizes):
                slots[f"{pre}self_attn.{proj}_proj.{kind}"] = (param, start, size)
        del slots[f"{pre}mlp.gate_up_proj.weight"]
        inter = c.intermediate_size
        slots[f"{pre}mlp.gate_proj.weight"] = (mlp.weight, 0, inter)
        slots[f"{pre}mlp.up_proj.weight"] = (mlp.weight, inter, inter)
    return slots


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
