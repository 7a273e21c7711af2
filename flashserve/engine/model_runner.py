"""Turns a scheduled step into device tensors, runs the model and samples.

The runner owns the device state: the model, the paged KV cache (one K and one V pool per
layer) and the sampler. It builds one ``AttentionMetadata`` per step, shared by every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from flashserve.config import EngineConfig
from flashserve.engine.sequence import Sequence
from flashserve.models.attention import AttentionMetadata
from flashserve.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 2 << 30  # default KV pool on CPU: 2 GiB (allocated lazily by the OS)


@dataclass
class HostInputs:
    """A step's inputs as host lists, before they become device tensors."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    seq_lens: list[int]  # [B] KV length after this step
    q_lens: list[int]  # [B] tokens computed this step
    block_tables: np.ndarray  # [B, M] int32, zero padded
    num_decodes: int  # the first num_decodes sequences compute one token each
    sample_rows: list[int]  # [N] token rows whose logits are sampled


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64, rows of the hidden states to sample from


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (id, logprob) best first, when logprobs were asked


@dataclass
class Launched:
    """A decode step queued on the device, not waited for (``ModelRunner.launch``).

    ``picks`` holds each row's token id and its log-probability, on the device, for the next
    step to take its input tokens from; ``host`` receives a copy of it, complete once ``done``
    has fired (None: already complete, on the CPU).
    """

    seqs: list[Sequence]
    picks: torch.Tensor  # [2, >= B] float64 on the device: token ids, logprobs
    host: torch.Tensor  # [2, >= B] float64, pinned on CUDA
    done: torch.cuda.Event | None

    def tokens(self) -> list[SampledToken]:
        """Wait for the step; its tokens in the order of ``seqs``."""
        if self.done is not None:
            self.done.synchronize()
        return _picked(self.host.tolist(), len(self.seqs))


class ModelRunner:
    """Holds the model and its KV cache; ``execute`` runs one scheduled step."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config):
        self.config = config
        self.model = model
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        mc = model_config
        self.kv_shape = (config.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_bytes_per_token = (
            2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
            * torch.empty((), dtype=config.torch_dtype).element_size()
        )  # fmt: skip
        self.num_blocks = self._plan_num_blocks()
        self.max_model_len = self._resolve_max_model_len()
        model.ensure_positions(self.max_model_len)
        self.kv_caches = [(self._new_pool(), self._new_pool()) for _ in range(mc.num_hidden_layers)]
        self.sampler = Sampler(mc.vocab_size, self.device)
        self._landing = self._landing_buffers()
        self._num_launched = 0
        self.graphs = None
        if self.device.type == "cuda" and config.attention_backend == "triton":
            if not config.enforce_eager:
                from flashserve.engine.cuda_graph import DecodeGraphs

                self.graphs = DecodeGraphs(self)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB); max model len %d",
            self.num_blocks, self.block_size, self.num_kv_tokens,
            self.num_kv_tokens * self.kv_bytes_per_token / 2**30, self.max_model_len,
        )  # fmt: skip

    @property
    def num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _new_pool(self) -> torch.Tensor:
        shape = (self.num_blocks, *self.kv_shape)
        # zeros on CUDA: padded rows of a captured decode batch read block 0 and must see finite
        # values; on the CPU, empty keeps the untouched pool out of resident memory
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        return alloc(shape, dtype=self.config.torch_dtype, device=self.device)

    def _landing_buffers(self) -> list[torch.Tensor]:
        """Two pinned float64 buffers of ``2 * max_num_seqs`` that launched steps copy their
        picks into, in turn: a step's copy never lands on the one the step before it left
        unread. A step's [2, B] picks land in the first 2B entries, viewed as [2, B]: the
        destination must be contiguous. (A [2, max_num_seqs] buffer sliced to [:, :B] is
        strided, and torch copies into a strided host tensor through a pageable temporary,
        synchronously: the host waited for every step, which undid async scheduling whenever
        B < max_num_seqs. H100, batch 8 at 4K: 8.6 ms per step with max_num_seqs 32 against
        7.4 with 8, and the same with only batch <= 8 graphs captured.)"""
        if self.device.type != "cuda":
            return []
        n = 2 * self.config.max_num_seqs
        return [torch.zeros(n, dtype=torch.float64, pin_memory=True) for _ in range(2)]

    def _plan_num_blocks(self) -> int:
        """Blocks in the KV pool: --max-kv-tokens, else what free memory allows."""
        if self.config.max_kv_tokens is not None:
            return self.config.max_kv_tokens // self.block_size
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            want = self.config.max_num_seqs * self._model_len_limit() * self.kv_bytes_per_token
            budget = min(CPU_KV_BYTES, want)
        num_blocks = int(budget // (self.kv_bytes_per_token * self.block_size))
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache; lower --max-model-len or "
                               "raise --gpu-memory-utilization")  # fmt: skip
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Free device memory within --gpu-memory-utilization, less activations of a step."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        mc = self.model_config
        tokens = self.config.max_num_batched_tokens
        # activations of the widest step: a few hidden-size and MLP-size buffers per token,
        # plus fp32 logits for up to max_num_seqs rows; doubled for the allocator's slack
        act = tokens * (6 * mc.hidden_size + 3 * mc.intermediate_size) * 4
        act += self.config.max_num_seqs * mc.vocab_size * 4 * 3
        return int(total * self.config.gpu_memory_utilization - used - 2 * act)

    def _model_len_limit(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings

    def _resolve_max_model_len(self) -> int:
        limit = self._model_len_limit()
        if self.config.max_model_len and limit > self.model_config.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's %d positions",
                           limit, self.model_config.max_position_embeddings)  # fmt: skip
        if limit > self.num_kv_tokens:
            logger.warning("KV pool holds %d tokens: max model len lowered from %d",
                           self.num_kv_tokens, limit)  # fmt: skip
            limit = self.num_kv_tokens
        return limit

    # ---- one step -------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> HostInputs:
        """Flattened inputs of a step on the host: decodes (one token each) first, then prefill
        chunks. Work per sequence is O(tokens scheduled + blocks), not O(context)."""
        bs = self.block_size
        ids: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        q_lens: list[int] = []
        sample_rows: list[int] = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            ids.extend(_token_slice(seq, start, n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            q_lens.append(n)
            if seq.samples_this_step:
                sample_rows.append(len(ids) - 1)
        positions = [p for s, n in zip(seq_lens, q_lens) for p in range(s - n, s)]
        return HostInputs(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            seq_lens=seq_lens,
            q_lens=q_lens,
            block_tables=_pad_tables([s.block_table for s in seqs]),
            num_decodes=_count_leading_ones(q_lens),
            sample_rows=sample_rows,
        )

    def prepare_ahead(self, seqs: list[Sequence], rows: list[int]) -> HostInputs:
        """Inputs of a decode step queued while the step before it still runs: each sequence
        computes position ``num_tokens``, the token that step picks in row ``rows[i]`` (the
        input ids hold those rows; ``launch`` gathers the tokens on the device). Block tables
        must already hold that position."""
        bs = self.block_size
        positions = [s.num_tokens for s in seqs]
        b = len(seqs)
        return HostInputs(
            input_ids=rows,
            positions=positions,
            slot_mapping=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
            seq_lens=[p + 1 for p in positions],
            q_lens=[1] * b,
            block_tables=_pad_tables([s.block_table for s in seqs]),
            num_decodes=b,
            sample_rows=list(range(b)),
        )

    def to_device(self, host: HostInputs) -> StepInputs:
        dev = self.device
        tensor = lambda x, dt: torch.as_tensor(x, dtype=dt).to(dev, non_blocking=True)
        nd, q_lens, seq_lens = host.num_decodes, host.q_lens, host.seq_lens
        has_prefill = len(q_lens) > nd
        cu = np.zeros(len(q_lens) - nd + 1, dtype=np.int32)
        np.cumsum(q_lens[nd:], out=cu[1:])
        meta = AttentionMetadata(
            slot_mapping=tensor(host.slot_mapping, torch.int64),
            num_decode_tokens=nd,
            decode_seq_lens=tensor(seq_lens[:nd], torch.int32) if nd else None,
            decode_block_tables=tensor(host.block_tables[:nd], torch.int32) if nd else None,
            max_decode_seq_len=max(seq_lens[:nd], default=0),
            num_prefill_tokens=len(host.input_ids) - nd,
            prefill_cu_seqlens_q=tensor(cu, torch.int32) if has_prefill else None,
            prefill_seq_lens=tensor(seq_lens[nd:], torch.int32) if has_prefill else None,
            prefill_block_tables=(
                tensor(host.block_tables[nd:], torch.int32) if has_prefill else None
            ),
            max_prefill_query_len=max(q_lens[nd:], default=0),
            max_prefill_seq_len=max(seq_lens[nd:], default=0),
        )
        return StepInputs(
            input_ids=tensor(host.input_ids, torch.int64),
            positions=tensor(host.positions, torch.int64),
            meta=meta,
            sample_indices=tensor(host.sample_rows, torch.int64),
        )

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence]) -> list[SampledToken]:
        """Run one step over ``seqs`` (scheduled, decodes first); one sampled token for each
        sequence whose chunk reaches its last token, in the order of ``seqs``."""
        host = self.prepare(seqs)
        sampling = [s for s in seqs if s.samples_this_step]
        if self.graphs is not None and self.graphs.can_run(host):
            logits, greedy = self.graphs.run(host)  # [B, V] fp32; every decode samples
            if self.sampler.plain_greedy(sampling):
                return _picked(greedy.tolist(), len(seqs))  # the step's one device -> host copy
        else:
            logits = self._forward_eager(host)
            if logits is None:
                return []
        out = self.sampler(logits, self.sampler.prepare(sampling))
        return _to_host(out)

    def _forward_eager(self, host: HostInputs, source: torch.Tensor | None = None
                       ) -> torch.Tensor | None:  # fmt: skip
        """The model without a graph: logits [N, V] fp32 of the sampled rows, None when no
        row samples. ``source``: input ids are indices into it (see ``launch``)."""
        inputs = self.to_device(host)
        if source is not None:
            inputs.input_ids.copy_(source[inputs.input_ids])
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not host.sample_rows:
            return None
        return self.model.compute_logits(hidden[inputs.sample_indices])

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], host: HostInputs, after: Launched | None = None
               ) -> Launched:  # fmt: skip
        """Queue a decode-only step and return without waiting for it. Every row decodes one
        token, without penalties or top logprobs (``Sampler.overlappable``).

        With ``after`` (the step queued before this one, whose tokens the host has not read),
        ``host`` comes from ``prepare_ahead``: row i's input token is the one ``after`` picks
        in row ``host.input_ids[i]``, gathered on the device."""
        source = None if after is None else after.picks[0]
        use_graph = self.graphs is not None and self.graphs.can_run(host)
        graph_picks = use_graph and Sampler.plain_greedy(seqs)  # the graph's greedy picks
        # the sampler's inputs go first: their copy then never waits for this step's forward
        batch = None if graph_picks else self.sampler.prepare(seqs, ahead=after is not None)
        if use_graph:
            logits, picks = self.graphs.run(host, source)
        else:
            logits = self._forward_eager(host, source)
        if not graph_picks:
            out = self.sampler(logits, batch)
            picks = torch.stack((out.token_ids.double(), out.logprobs.double()))
        if self.device.type != "cuda":
            return Launched(seqs, picks, picks, None)
        landing = self._landing[self._num_launched % 2][: picks.numel()].view(picks.shape)
        self._num_launched += 1
        landing.copy_(picks, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(seqs, picks, landing, done)


def _picked(picks: list[list[float]], n: int) -> list[SampledToken]:
    """The first ``n`` rows of picks read back as [token ids, logprobs]."""
    ids, logprobs = picks
    return [SampledToken(int(i), lp, None) for i, lp in zip(ids[:n], logprobs[:n])]


def _token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """``seq.token_ids[start:start+n]`` without concatenating prompt and output."""
    p = seq.num_prompt_tokens
    if start >= p:
        return seq.output_token_ids[start - p : start - p + n]
    if start + n <= p:
        return seq.prompt_token_ids[start : start + n]
    return seq.token_ids[start : start + n]


def _count_leading_ones(q_lens: list[int]) -> int:
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def _to_host(out) -> list[SampledToken]:
    """One device-to-host transfer for everything the step returns."""
    ids = out.token_ids.tolist()
    lps = out.logprobs.tolist()
    if out.top_ids is None:
        return [SampledToken(i, lp, None) for i, lp in zip(ids, lps)]
    top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
    return [
        SampledToken(i, lp, list(zip(ti, tl))) for i, lp, ti, tl in zip(ids, lps, top_ids, top_lps)
    ]
