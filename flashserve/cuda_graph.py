"""CUDA graphs for decode-only steps, one per batch-size bucket.

A graph has a fixed grid, so everything a captured step reads lives in static buffers: token
ids, positions, cache slots, per-sequence KV lengths and block tables. The decode kernel gets
``max_model_len`` as its length hint and reads each sequence's real length from device memory.
A batch of B decodes runs the graph of the smallest bucket >= B, padding rows with one token of
KV length 1 whose slot is -1 (nothing is written), and its logits rows beyond B are ignored.

Each graph also picks every row's greedy token and its log-probability
(``kernels.sampling.greedy_sample``) into one float64 ``[2, B]`` tensor, so that a batch of
plain greedy requests skips the sampler and reads its tokens back in one copy.
"""

from __future__ import annotations

import logging
import time

import torch

from flashserve.attention import AttentionMetadata
from kernels.sampling import greedy_sample

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (as vLLM does: padding waste <= 7 rows)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured decode steps (model forward + logits) for each batch-size bucket."""

    def __init__(self, runner):
        self.runner = runner
        self.buckets = batch_buckets(runner.config.max_num_seqs)
        n = self.buckets[-1]
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        # bucket -> (graph, logits [b, V] float32, greedy [2, b] float64: token ids, logprobs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        start = time.perf_counter()
        self._capture_all()
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs),
                    self.buckets, time.perf_counter() - start)  # fmt: skip

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_decode_tokens=b,
            decode_seq_lens=self.seq_lens[:b],
            decode_block_tables=self.block_tables[:b],
            max_decode_seq_len=self.runner.max_model_len,
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=None,
            prefill_seq_lens=None,
            prefill_block_tables=None,
            max_prefill_query_len=0,
            max_prefill_seq_len=0,
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.runner.model
        hidden = model(self.input_ids[:b], self.positions[:b], self.runner.kv_caches, self._meta(b))
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
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, greedy = self._forward(b)
                self.graphs[b] = (graph, logits, greedy)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, host) -> bool:
        """A decode-only step that fits the largest bucket and the captured tables."""
        b = len(host.q_lens)
        return (
            b > 0
            and host.num_decodes == b
            and len(host.sample_rows) == b
            and b <= self.buckets[-1]
            and host.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, host) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step: logits [B, V] float32 and the greedy picks [2, B] float64."""
        b = len(host.q_lens)
        bucket = next(x for x in self.buckets if x >= b)
        cpu = lambda x, dt: torch.as_tensor(x, dtype=dt)
        self.input_ids[:b].copy_(cpu(host.input_ids, torch.int64), non_blocking=True)
        self.positions[:b].copy_(cpu(host.positions, torch.int64), non_blocking=True)
        self.slot_mapping[:b].copy_(cpu(host.slot_mapping, torch.int64), non_blocking=True)
        self.seq_lens[:b].copy_(cpu(host.seq_lens, torch.int32), non_blocking=True)
        width = host.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(host.block_tables), non_blocking=True)
        if bucket > b:  # padding rows: KV length 1, nothing written
            self.slot_mapping[b:bucket].fill_(-1)
            self.seq_lens[b:bucket].fill_(1)
            self.block_tables[b:bucket, 0].fill_(0)
        graph, logits, greedy = self.graphs[bucket]
        graph.replay()
        return logits[:b], greedy[:, :b]
