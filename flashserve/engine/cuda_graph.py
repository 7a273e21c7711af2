"""CUDA graphs for decode-only steps, one per batch-size bucket.

A graph has a fixed grid, so everything a captured step reads lives in static buffers: the
fixed tensors of the graphs' own staging (``flashserve.engine.staging``), token ids and
positions here, the attention metadata's buffers as the backend describes them
(``AttentionBackend.graph_buffers``). A step writes its values into their leading rows in its
one upload (``stage``, the backend's ``replay_metadata`` writing the metadata) and replays.
The decode kernel gets ``max_model_len`` as its length hint and reads each sequence's real
length from device memory. A batch of B decodes runs the graph of the smallest bucket >= B,
padding rows with one token of KV length 1 whose slot is -1 (nothing is written), and its
logits rows beyond B are ignored.

Under tensor parallelism a graph holds the step's NCCL collectives too (the all-reduces, the
logits' gather): every rank captures the same buckets in the same order and replays them in
step (the communicator was warmed up before: ``TPGroup.join``).

Each graph also picks every row's greedy token and its log-probability
(``kernels.sampling.greedy_sample``) into one float64 ``[2, B]`` tensor, so that a batch of
plain greedy requests skips the sampler and reads its tokens back in one copy.
"""

from __future__ import annotations

import logging
import time

import torch

from flashserve.engine.staging import Staging
from flashserve.engine.step_plan import StepPlan
from kernels.common import table_columns
from kernels.sampling import greedy_sample

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (as vLLM does: padding waste <= 7 rows)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def graph_layout(runner) -> tuple[list[int], int, dict]:
    """A runner's decode graphs: their batch buckets, the block-table width they capture (the
    blocks of max_model_len, in the eager steps' columns, ``table_columns``: the kernels see
    one row-stride kind in graphs and eager steps alike, so that a kernel compiled for one
    serves the other), and the static buffers' specs (name -> (shape, dtype)) for the largest
    bucket, which every graph reads views of."""
    buckets = batch_buckets(runner.config.max_num_seqs)
    n = buckets[-1]
    max_blocks = table_columns(-(-runner.max_model_len // runner.block_size))
    fixed = {
        "input_ids": ((n,), torch.int64),
        "positions": ((n,), torch.int64),
        **runner.backend.graph_buffers(n, max_blocks),
    }
    return buckets, max_blocks, fixed


class DecodeGraphs:
    """Captured decode steps (model forward + logits + greedy picks) for each batch-size bucket.

    Their staging holds, below the static buffers, room for what else a step sends (the
    sampler's per-row inputs: 44 bytes a row; block tables sent dense, ``Upload.put_rows``:
    under a quarter of the table buffer); anything larger spills to the runner's staging.
    """

    def __init__(self, runner):
        self.runner = runner
        self.backend = runner.backend
        self.buckets, self.max_blocks, fixed = graph_layout(runner)
        n = self.buckets[-1]
        dynamic = 64 * n + n * self.max_blocks + 4096
        self.staging = Staging(runner.device, dynamic, fixed, spill=runner.staging)
        # bucket -> (graph, logits [b, V] float32, greedy [2, b] float64: token ids, logprobs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        start = time.perf_counter()
        self._capture_all()
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs),
                    self.buckets, time.perf_counter() - start)  # fmt: skip

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        static = self.staging.fixed
        meta = self.backend.capture_metadata(static, b, self.runner.max_model_len)
        model = self.runner.model
        hidden = model(static["input_ids"][:b], static["positions"][:b], self.runner.kv_caches,
                       meta)  # fmt: skip
        logits = model.compute_logits(hidden)
        ids, logprobs = greedy_sample(logits)
        return logits, torch.stack((ids.double(), logprobs.double()))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first, so smaller ones reuse its pool
                self._forward(b)  # warm-up: compiles kernels outside the capture
                if self.runner.tp.size > 1:  # tensor parallel: its NCCL collectives done, so
                    torch.cuda.synchronize()  # that NCCL's watchdog has none to poll mid-capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, greedy = self._forward(b)
                self.graphs[b] = (graph, logits, greedy)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, plan: StepPlan) -> bool:
        """A decode-only step that fits the largest bucket and the captured tables."""
        return (
            plan.is_decode
            and plan.batch_size <= self.buckets[-1]
            and plan.table_width <= self.max_blocks
        )

    def stage(self, plan: StepPlan, upload) -> int:
        """Write the step's inputs into the static buffers through ``upload`` (from
        ``self.staging.begin()``), padding rows up to the bucket; the bucket it replays."""
        b = plan.batch_size
        bucket = next(x for x in self.buckets if x >= b)
        pad = bucket - b
        upload.put("input_ids", plan.input_ids + [0] * pad)
        upload.put("positions", plan.positions + [0] * pad)
        self.backend.replay_metadata(plan, bucket, upload)
        return bucket

    def input_ids(self, b: int) -> torch.Tensor:
        """The static input ids of a batch of ``b`` (a look-ahead step's runner writes its
        tokens there, after staging and before ``replay``)."""
        return self.staging.fixed["input_ids"][:b]

    def release(self) -> None:
        """Destroy the captured graphs now (not when the last reference goes). Under tensor
        parallelism this must come before the NCCL group is destroyed: NCCL counts every graph
        that captured one of its collectives, and its communicator's teardown waits until those
        graphs are gone (seen on two H200s, 2026-11-26: ``destroy_process_group`` hung on both
        ranks with the graphs alive)."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        torch.cuda.synchronize(self.runner.device)

    def replay(self, b: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the staged step (its upload sent): logits [B, V] float32 and the greedy picks
        [2, bucket] float64 (the whole bucket: read back as it is, one contiguous copy; rows
        past B are padding)."""
        graph, logits, greedy = self.graphs[bucket]
        graph.replay()
        return logits[:b], greedy
