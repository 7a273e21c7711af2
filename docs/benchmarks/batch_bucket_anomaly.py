"""Batch-8 decode step time at 4K under variants of what the process captured (issue 13, item 6).

python3 docs/benchmarks/batch_bucket_anomaly.py VARIANT [STEPS]: one engine per process, prints
the ms per step of three timed runs.
"""

import sys
import time

import torch

import flashserve.engine.cuda_graph as cg
from flashserve.bench.decode_ours import measure_ours
from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLMEngine

variant = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
seqs = 8 if variant.startswith("only8") else 32
eager = variant.endswith("eager")

if variant == "all-smallfirst":  # capture the smallest bucket first (the engine: largest first)

    def capture_all(self):
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.buckets:
                self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, greedy = self._forward(b)
                self.graphs[b] = (graph, logits, greedy)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    cg.DecodeGraphs._capture_all = torch.inference_mode()(capture_all)
if variant == "all-ownpool":  # every graph its own memory pool

    def capture_all(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    logits, greedy = self._forward(b)
                self.graphs[b] = (graph, logits, greedy)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    cg.DecodeGraphs._capture_all = torch.inference_mode()(capture_all)
if variant == "all-only8graph":  # max_num_seqs 32, but only buckets <= 8 captured
    cg.batch_buckets = lambda n: [1, 2, 4, 8]

config = EngineConfig(
    model="dummy:llama3.1-8b", max_num_seqs=seqs, max_model_len=8192, enforce_eager=eager
)
t0 = time.perf_counter()
engine = LLMEngine(config)
load = time.perf_counter() - t0
gen = torch.Generator().manual_seed(0)
measure_ours(engine, 4096, 8, 2, gen)  # first-use costs
runs = []
for _ in range(3):
    timing, _ = measure_ours(engine, 4096, 8, steps, gen)
    runs.append(timing.step_s * 1e3)
buckets = sorted(engine.runner.graphs.graphs) if engine.runner.graphs else "eager"
print(
    f"RESULT {variant:16s} {' '.join(f'{r:.3f}' for r in runs)}  (load {load:.0f} s, "
    f"blocks {engine.runner.num_blocks}, graphs {buckets})",
    flush=True,
)
