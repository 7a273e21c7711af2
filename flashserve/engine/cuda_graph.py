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

from flashserve.models.attention import AttentionMetadata
from kernels.sampling import greedy_sample

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (as vLLM does: padding waste <= 7 rows)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured decode steps (model forward + logits + greedy picks) for each batch-size bucket.

    A step's inputs travel in two copies from pinned host buffers: token ids, positions, slots
    and KV lengths packed as int64 (the graph of bucket ``b`` reads them at offsets 0, b, 2b and
    3b of ``inputs``, and casts the lengths to int32 itself), then the block tables.
    """

    def __init__(self, runner):
        self.runner = runner
        self.buckets = batch_buckets(runner.config.max_num_seqs)
        n = self.buckets[-1]
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.inputs = torch.zeros(4 * n, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self._host_inputs = torch.zeros(4 * n, dtype=torch.int64, pin_memory=True)
        self._host_tables = torch.zeros(n * self.max_blocks, dtype=torch.int32, pin_memory=True)
        self._copied = torch.cuda.Event()  # recorded after each step's copies out of them
        # bucket -> (graph, logits [b, V] float32, greedy [2, b] float64: token ids, logprobs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        start = time.perf_counter()
        self._capture_all()
        logger.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs),
                    self.buckets, time.perf_counter() - start)  # fmt: skip

    def _meta(self, b: int, slots: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=b,
            decode_seq_lens=seq_lens,
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
        ids, positions, slots, seq_lens = self.inputs[: 4 * b].view(4, b)
        meta = self._meta(b, slots, seq_lens.to(torch.int32))
        model = self.runner.model
        hidden = model(ids, positions, self.runner.kv_caches, meta)
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

    def run(self, host, source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step: logits [B, V] float32 and the greedy picks [2, bucket] float64 (the
        whole bucket: read back as it is, one contiguous copy; rows past B are padding).
        With ``source`` (token ids on the device), ``host.input_ids`` are indices into it: the
        input tokens are gathered there, after the copy."""
        b = len(host.q_lens)
        bucket = next(x for x in self.buckets if x >= b)
        self._copied.synchronize()  # the pinned buffers are free once last step's copies are
        packed = self._host_inputs.numpy()[: 4 * bucket].reshape(4, bucket)
        packed[:, :b] = (host.input_ids, host.positions, host.slot_mapping, host.seq_lens)
        packed[:, b:] = ((0,), (0,), (-1,), (1,))  # padding rows: KV length 1, nothing written
        self.inputs[: 4 * bucket].copy_(self._host_inputs[: 4 * bucket], non_blocking=True)
        if source is not None:
            ids = self.inputs[:b]
            ids.copy_(source[ids])
        self._copy_tables(host.block_tables)
        self._copied.record()
        graph, logits, greedy = self.graphs[bucket]
        graph.replay()
        return logits[:b], greedy

    def _copy_tables(self, tables) -> None:
        """Block tables [b, width] into the first b rows. One contiguous copy of the rows'
        span (the tails of rows before the last come along: stale but valid block ids, never
        read past a sequence's length) unless that span is mostly tail; padding rows keep
        whatever valid ids they hold."""
        b, width = tables.shape
        span = (b - 1) * self.max_blocks + width
        if span > 4 * b * width + 4096:
            self.block_tables[:b, :width].copy_(torch.from_numpy(tables), non_blocking=True)
            return
        host = self._host_tables.numpy()[: b * self.max_blocks].reshape(b, self.max_blocks)
        host[:, :width] = tables
        dst = self.block_tables.view(-1)[:span]
        dst.copy_(self._host_tables[:span], non_blocking=True)
