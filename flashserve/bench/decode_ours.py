"""``bench decode``, our side: time decode steps of the engine at a given context and batch."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashserve.bench.hardware import peak_memory, reset_peak_memory, synchronize
from flashserve.bench.profiling import PROFILE_STEPS, profile_steps
from flashserve.sampling.params import SamplingParams

if TYPE_CHECKING:  # the model stack loads when the benchmark runs, not with the CLI
    from flashserve.engine.llm_engine import LLMEngine

WARMUP_STEPS = 2  # decode steps run before timing (allocator, kernels' first launch)


@dataclass
class StepTiming:
    """What one implementation did at one (context, batch) point."""

    step_s: float  # seconds per decode step (one token for every sequence)
    kv_tokens_per_step: float  # KV positions held per step, summed over the batch
    peak_memory_bytes: int
    memory_kind: str
    # KV bytes read per step: each layer reads only the positions its window covers
    kv_bytes_per_step: float = 0.0


def new_tokens_needed(budget: int, context: int, batch: int, steps: int) -> int:
    """Tokens each sequence is allowed to generate: the timed and warm-up steps, plus what an
    early sequence may generate while the rest of the batch is still prefilling (the
    scheduler runs decodes first, then prefill chunks under the step's token ``budget``)."""
    slack = math.ceil(batch * context / max(1, budget - batch)) + batch + 2
    return slack + WARMUP_STEPS + steps


def why_not(engine: LLMEngine, context: int, batch: int, steps: int) -> str | None:
    """Why the point cannot run in this engine (None when it can)."""
    budget = engine.config.max_num_batched_tokens
    total = context + new_tokens_needed(budget, context, batch, steps)
    if batch > engine.config.max_num_seqs:
        return f"batch {batch} over --max-num-seqs {engine.config.max_num_seqs}"
    if total > engine.max_model_len:
        why = f"needs {total} tokens per sequence, max model len is {engine.max_model_len}"
        if engine.config.max_model_len and engine.max_model_len < engine.config.max_model_len:
            why += " (capped by the KV pool: try a larger --gpu-memory-utilization)"
        return why
    bs = engine.config.block_size
    need = batch * math.ceil(total / bs)
    have = engine.runner.num_blocks
    if need > have:
        return (f"needs {need * bs} KV tokens, the pool holds {have * bs} (a larger "
                "--gpu-memory-utilization or --max-kv-tokens makes it larger)")  # fmt: skip
    return None


def measure_ours(
    engine: LLMEngine,
    context: int,
    batch: int,
    steps: int,
    gen: torch.Generator,
    profile_dir: str | None = None,
) -> tuple[StepTiming, dict | None]:
    """Prefill ``batch`` random prompts of ``context`` tokens (not timed), then time ``steps``
    decode steps of the whole batch, then (with ``profile_dir``) profile a few more: the
    timing and the profile's summary. The requests are aborted at the end. ``steps`` must
    include the profiled steps."""
    device = engine.runner.device
    reset_peak_memory(device)
    new = new_tokens_needed(engine.config.max_num_batched_tokens, context, batch, steps)
    timed = steps - PROFILE_STEPS if profile_dir else steps
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch, context), generator=gen).tolist()
    reqs = [engine.make_request(p, params) for p in prompts]
    for req in reqs:
        engine.add(req)
    try:
        while any(r.seq.num_output_tokens == 0 for r in reqs):
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        timing = _time_steps(engine, reqs, timed, device)
        if not profile_dir:
            return timing, None
        return timing, profile_steps(engine, device, profile_dir, f"decode-{context}x{batch}")
    finally:
        for req in reqs:
            engine.abort(req.request_id)


def kv_bytes_read(layer_windows: tuple[int, ...], layer_bytes_per_token: float,
                  num_tokens: int) -> float:  # fmt: skip
    """KV bytes a decode step reads for one sequence of ``num_tokens`` tokens (its new one
    included): each layer reads K and V of the last ``window`` of them, all of them when it
    has no window (``ModelConfig.layer_windows``). ``layer_bytes_per_token``: one layer's K
    and V of a token in the cache's dtype, an fp8 cache's scales included
    (``ModelRunner.kv_bytes_per_token`` over the layers)."""
    positions = sum(min(num_tokens, w) if w > 0 else num_tokens for w in layer_windows)
    return positions * layer_bytes_per_token


def _time_steps(engine: LLMEngine, reqs, steps: int, device: torch.device) -> StepTiming:
    windows = engine.model_config.layer_windows
    per_layer = engine.runner.kv_bytes_per_token / len(windows)  # one layer's K and V
    kv_tokens, kv_bytes = 0, 0.0
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        lens = [r.seq.num_tokens for r in reqs]  # the new token's KV is read too
        kv_tokens += sum(lens)
        kv_bytes += sum(kv_bytes_read(windows, per_layer, n) for n in lens)
        outs = engine.step()
        if len(outs) != len(reqs) or any(o.finished for o in outs):
            raise RuntimeError(f"a timed step was not a decode of all {len(reqs)} sequences")
    synchronize(device)
    elapsed = time.perf_counter() - start
    mem, kind = peak_memory(device)
    return StepTiming(elapsed / steps, kv_tokens / steps, mem, kind, kv_bytes / steps)


def weight_bytes_read(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: every parameter at its own element size (fp8
    projections one byte a weight, plus their float32 scales), except an untied input
    embedding table (a step reads only its batch's rows of it). Under tensor parallelism, rank
    0's share (its model is that)."""
    model = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def release_kv_cache(engine: LLMEngine) -> None:
    """Free the engine's KV pool and CUDA graphs (the peer runs next on the same device);
    the weights stay. The engine cannot run after this."""
    engine.runner.kv_caches = []
    engine.runner.graphs = None
    gc.collect()
    if engine.runner.device.type == "cuda":
        torch.cuda.empty_cache()
