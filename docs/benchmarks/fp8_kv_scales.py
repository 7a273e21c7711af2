"""The two choices behind the fp8 KV cache's scales, measured on the CPU (docs/benchmarks/fp8.md).

1. The scales' dtype: the K/V of the default model over the first 4,096 tokens of README.md
   (captured where the torch backend writes them) quantized with float32, bf16 and fp16 scales;
   relative error of the round trip, per K and V over all layers.
2. Per-token dynamic scales (ours) against a static per-layer scale of 1.0 (vLLM's default for
   a checkpoint without calibrated scales): ``flashserve bench accuracy``'s measurements with
   the torch backend's quantizer swapped for one whose scale is always 1.0, both against the
   float32 cache.

    PYTHONPATH=. python docs/benchmarks/fp8_kv_scales.py [--tokens 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from flashserve.bench import accuracy
from flashserve.config import EngineConfig
from kernels import reference
from kernels.kv_quant import FP8_AMAX_FLOOR, FP8_KV_DTYPE, FP8_MAX, KV_SCALE_DTYPE


def captured_kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) [T, Hkv, D] of every layer and prefill chunk, as the torch backend writes them."""
    from flashserve.engine.llm_engine import LLM

    got = []
    write = reference.write_kv

    def record(k, v, *args, **kwargs):
        got.append((k.detach().clone(), v.detach().clone()))
        return write(k, v, *args, **kwargs)

    reference.write_kv = record
    try:
        llm = LLM(EngineConfig(device="cpu"))
        ids = llm.tokenizer.encode(accuracy.read_text(None)[1])[:tokens]
        for _ in llm.engine.prompt_logits(ids):
            pass
    finally:
        reference.write_kv = write
    return got


def round_trip(x: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """``kv_quant.quantize_fp8`` then dequantized, with scales rounded to ``scale_dtype``."""
    xf = x.float()
    scale = (xf.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX).to(scale_dtype).float()
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return q.float() * scale[..., None]


def scale_dtypes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        row = {}
        for i, name in enumerate("kv"):
            err = sum(float((round_trip(p[i], dtype) - p[i]).pow(2).sum()) for p in kv)
            norm = sum(float(p[i].float().pow(2).sum()) for p in kv)
            row[name] = (err / norm) ** 0.5
        out[str(dtype).removeprefix("torch.")] = row
    amax = torch.cat([p[i].abs().amax(-1).flatten() for p in kv for i in (0, 1)])
    out["amax"] = {"min": float(amax.min()), "median": float(amax.median()),
                   "max": float(amax.max())}  # fmt: skip
    return out


def static_scale_one(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A static scale of 1.0: ``x`` clamped to +-448 and rounded to e4m3, scale 1."""
    q = x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return q, torch.ones(x.shape[:-1], dtype=KV_SCALE_DTYPE, device=x.device)


def static_vs_dynamic(tokens: int, prompts: int, max_new: int) -> dict:
    text = accuracy.read_text(None)[1]
    texts = accuracy.prompts(prompts)
    base = accuracy.measure(EngineConfig(device="cpu"), text, tokens, texts, max_new)
    fp8 = EngineConfig(device="cpu", kv_cache_dtype="fp8")
    out = {"dynamic": accuracy.measure(fp8, text, tokens, texts, max_new, against=base)}
    quantize = reference.quantize_fp8
    reference.quantize_fp8 = static_scale_one  # what write_kv calls
    try:
        out["static_1.0"] = accuracy.measure(fp8, text, tokens, texts, max_new, against=base)
    finally:
        reference.quantize_fp8 = quantize
    return {k: {"teacher_forced": v["teacher_forced"], "greedy": v["greedy"]}
            for k, v in out.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"scale_dtypes": scale_dtypes(captured_kv(args.tokens))}
    print(json.dumps(result, indent=1), flush=True)
    result["static_vs_dynamic"] = static_vs_dynamic(args.tokens, args.prompts,
                                                    args.max_new_tokens)  # fmt: skip
    print(json.dumps(result["static_vs_dynamic"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
