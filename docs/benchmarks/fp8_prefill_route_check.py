"""The engine over an fp8 cache, prefill path auto (the Gluon kernel over dequantized pages)
against hopper (e4m3 tiles in the kernel): the same 5,000-token prompt through
``dummy:qwen2-0.5b`` (head dim 64), the last 64 positions' logits compared
(docs/benchmarks/fp8.md, session 22). On an H100/H200:

    python3 docs/benchmarks/fp8_prefill_route_check.py
"""

import gc

import torch

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLMEngine

ids = torch.randint(0, 150000, (5000,), generator=torch.Generator().manual_seed(1)).tolist()
res = {}
for path in ("auto", "hopper"):
    eng = LLMEngine(
        EngineConfig(
            model="dummy:qwen2-0.5b",
            kv_cache_dtype="fp8",
            prefill_path=path,
            max_model_len=8192,
            max_kv_tokens=16384,
            enable_prefix_caching=False,
        )
    )
    print(
        path, "scratch", eng.runner.fp8_prefill_scratch is not None, "block", eng.runner.block_size
    )
    res[path] = torch.cat(list(eng.prompt_logits(ids)))[-64:].float().cpu()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
a, h = res["auto"], res["hopper"]
rel = ((a - h).norm() / h.norm()).item()
agree = (a.argmax(-1) == h.argmax(-1)).float().mean().item()
print(f"last 64 positions: relative difference {rel:.2e}, argmax agreement {agree:.3f}")
