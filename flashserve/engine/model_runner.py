"""Turns a step into device tensors, runs the model and samples.

The runner owns the device state: the model, the paged KV cache (one K and one V pool per
The runner owns the device state: the model, the paged KV cache (one K and one V pool per
layer; an fp8 cache adds a K and a V scale pool per layer, ``kernels.kv_quant``), the sampler
and the staging that every host-to-device copy of a step goes through. A step is built once on
the host (``StepPlan``), sent in one upload, and then run one of two ways (``_run``): by
replaying a captured CUDA graph (decode-only steps) or eagerly. The attention backend builds
the step's ``AttentionMetadata``, shared by every layer.

Tensor parallelism: every rank has a runner over its share of the model (its KV heads' pools,
an fp8 cache's scale pools with them, of the block count all ranks agree on: the smallest).
Rank 0's runner sends each step's plan to the other ranks (``peers``) once its own inputs are
staged, then runs the same forward; the workers' runners ``follow`` those plans and sample
nothing. From that send to the end of the forward the ranks meet in collectives: a failure
there leaves them out of step, so the engine is dead (``EngineDeadError``) rather than
retrying the step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from flashserve.config import EngineConfig
from flashserve.engine.block_manager import peak_blocks
from flashserve.engine.errors import EngineDeadError
from flashserve.engine.sequence import Sequence
from flashserve.engine.staging import Staging, Upload
from flashserve.engine.step_plan import StepPlan
from flashserve.models.attention import AttentionMetadata
from flashserve.sampling.sampler import Sampler, SamplerOutput
from kernels.kv_quant import (
    KV_SCALE_DTYPE,
    head_major_pages,
    kv_bytes_per_token_layer,
    kv_scale_shape,
    new_kv_pool,
)
from kernels.prefill_paths import HOPPER_HEAD_DIMS, HOPPER_MIN_PAGE, gluon_triton_refusal

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 2 << 30  # default KV pool on CPU: 2 GiB (allocated lazily by the OS)
# the longest context whose fp8 pages the prefill dequantizes for the Gluon kernel: a 16-bit
# copy of one layer's K and V (512 MiB at 8 KV heads of 128); longer ones take the Hopper path
FP8_PREFILL_SCRATCH_TOKENS = 131072


def fp8_prefill_scratch_tokens(
    config: EngineConfig, model_config, max_len: int, capability: tuple[int, int], triton: str
) -> int:
    """Tokens of the 16-bit copy of one layer's K and V that the prefill over an fp8 cache
    reads with the Gluon kernel (``ModelRunner._fp8_prefill_scratch``): the context length
    ``max_len`` (at most ``FP8_PREFILL_SCRATCH_TOKENS``) rounded up to whole blocks; 0 where
    that kernel would not run: it needs an fp8 cache on the triton backend with the auto
    prefill path, a GPU of ``capability`` (9, 0) under a Triton (version ``triton``) whose
    Gluon it is written in, pages of >= 64 tokens, a 16-bit model of a head dim it takes, and
    a layer without a window or soft-capping."""
    if config.kv_cache_dtype != "fp8" or config.attention_backend != "triton":
        return 0
    if config.prefill_path != "auto" or config.torch_dtype not in (torch.bfloat16, torch.float16):
        return 0
    if config.block_size < HOPPER_MIN_PAGE or model_config.head_dim not in HOPPER_HEAD_DIMS:
        return 0
    if model_config.attn_logit_softcap > 0 or min(model_config.layer_windows) > 0:
        return 0
    if capability != (9, 0) or gluon_triton_refusal(triton) is not None:
        return 0
    tokens = min(max_len, FP8_PREFILL_SCRATCH_TOKENS)
    return -(-tokens // config.block_size) * config.block_size


@dataclass
class StepInputs:
    """A step's device tensors for an eager forward (views into the step's upload)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor | None  # [N] int64 rows to sample from; None: every row


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
    """Holds the model and its KV cache; ``execute`` runs one scheduled step.

    ``peers``: rank 0's handle on the other tensor-parallel ranks (``TPWorkers``); a worker's
    runner has none, and no sampler."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config,
                 peers=None):  # fmt: skip
        self.config = config
        self.model = model
        self.model_config = model_config
        self.tp = model.tp
        self.peers = peers
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        mc = model_config
        kv_heads = model.rank_config.num_key_value_heads  # this rank's
        self.kv_shape = (config.block_size, kv_heads, mc.head_dim)
        self.kv_dtype = config.torch_kv_dtype
        # pools whose pages hold a KV head's rows together (fp8 pages of >= 64 tokens)
        self.kv_head_major = head_major_pages(self.kv_dtype, self.block_size)
        # K and V of one token in every layer, this rank's KV heads: the pages, and an fp8
        # cache's scales
        self.kv_bytes_per_token = mc.num_hidden_layers * kv_bytes_per_token_layer(
            kv_heads, mc.head_dim, self.kv_dtype
        )
        # allocated before the pool is planned, so that it comes out of the pool's memory
        self.fp8_prefill_scratch = self._fp8_prefill_scratch()
        if self.fp8_prefill_scratch is not None:
            model.backend.use_fp8_prefill_scratch(self.fp8_prefill_scratch)
        # every rank's pool holds the same number of blocks, the smallest any rank can hold:
        # the one scheduler's block tables are then valid on each
        self.num_blocks = self.tp.min_int(self._plan_num_blocks())
        if self.num_blocks < 1:  # every rank raises: none waits for the others
            raise ValueError(self._no_kv_block())
        self.max_model_len = self._resolve_max_model_len()
        model.ensure_positions(self.max_model_len)
        # per layer (k, v), or for an fp8 cache (k, v, k_scale, v_scale)
        self.kv_caches = [self._new_layer_cache() for _ in range(mc.num_hidden_layers)]
        self.sampler = Sampler(mc.vocab_size, self.device) if self.tp.rank == 0 else None
        self.backend = model.backend
        self.staging = Staging(self.device)  # eager steps' uploads; graphs spill into it
        self._landing = self._landing_buffers()
        self._num_launched = 0
        self.graphs = None
        if self.device.type == "cuda" and config.attention_backend == "triton":
            if not config.enforce_eager:
                from flashserve.engine.cuda_graph import DecodeGraphs

                self.graphs = DecodeGraphs(self)
        # the decodes' length hint in steps that mix them with prefill chunks: the graphs'
        # (their split plans are compiled; prepare_metadata), none without graphs
        self.mixed_decode_len = self.max_model_len if self.graphs is not None else 0
        rank = f" per rank (its {kv_heads} KV heads)" if self.tp.size > 1 else ""
        layout = ", a head's rows together" if self.kv_head_major else ""
        logger.info(
            "KV cache: %s, %d blocks of %d tokens%s = %d tokens (%.2f GiB%s); max model len %d",
            config.kv_cache_dtype, self.num_blocks, self.block_size, layout, self.num_kv_tokens,
            self.kv_cache_bytes / 2**30, rank, self.max_model_len,
        )  # fmt: skip

    @property
    def num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pools (and an fp8 cache's scale pools), all layers; under tensor
        parallelism this rank's (its KV heads), as every rank's."""
        return self.num_kv_tokens * self.kv_bytes_per_token

    def _new_layer_cache(self) -> tuple[torch.Tensor, ...]:
        """One layer's pools: (k, v), and for an fp8 cache its scales (k, v, k_scale, v_scale).
        The K/V pools are ``[N, BS, Hkv, D]``, stored with a head's rows of a page together
        where ``kv_head_major`` (fp8 pages of 64 tokens and more)."""
        # zeros on CUDA: padded rows of a captured decode batch read block 0 and must see finite
        # values (fp8 zeros with zero scales too); on the CPU, empty keeps the untouched pool
        # out of resident memory
        zeros = self.device.type == "cuda"
        pools = tuple(new_kv_pool(self.num_blocks, *self.kv_shape, self.kv_dtype, self.device,
                                  self.kv_head_major, zeros) for _ in range(2))  # fmt: skip
        if self.config.kv_cache_dtype != "fp8":
            return pools
        alloc = torch.zeros if zeros else torch.empty
        scales = kv_scale_shape(self.num_blocks, *self.kv_shape[:2])
        return (*pools, *(alloc(scales, dtype=KV_SCALE_DTYPE, device=self.device)
                          for _ in range(2)))  # fmt: skip

    def _fp8_prefill_scratch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two 16-bit pools of ``fp8_prefill_scratch_tokens`` tokens, into which the prefill
        over an fp8 cache dequantizes a chunk's context to read it with the Gluon kernel
        (``kernels.kv_dequant``: the first token of a long prompt about as fast as over a bf16
        cache); None where that kernel would not run."""
        if self.device.type != "cuda" or self.config.attention_backend != "triton":
            return None  # (and Triton may not be there to ask its version)
        import triton

        capability = torch.cuda.get_device_capability(self.device)
        tokens = fp8_prefill_scratch_tokens(self.config, self.model_config,
                                            self._model_len_limit(), capability,
                                            triton.__version__)  # fmt: skip
        if not tokens:
            return None
        pages = tokens // self.block_size
        scratch = tuple(torch.empty(pages, *self.kv_shape, dtype=self.config.torch_dtype,
                                    device=self.device) for _ in range(2))  # fmt: skip
        logger.info("fp8 KV cache: a %s copy of one layer's K and V for %d tokens (%.2f GiB) "
                    "for the Gluon prefill kernel", self.config.dtype, tokens,
                    2 * scratch[0].nbytes / 2**30)  # fmt: skip
        return scratch

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
        """Blocks in this rank's KV pool: --max-kv-tokens, else --kv-cache-memory-bytes, else
        what free memory allows (0 or less: none)."""
        if self.config.max_kv_tokens is not None:
            return self.config.max_kv_tokens // self.block_size
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
            room = self._cuda_kv_budget(None) if self.device.type == "cuda" else budget
            if budget > room:  # -1: every rank then refuses (see __init__), none waits
                logger.error("kv_cache_memory_bytes %d is more than the %d bytes free on %s "
                             "after the weights and a step's activations", budget, room,
                             self.device)  # fmt: skip
                return -1
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget(self.config.gpu_memory_utilization)
        else:
            per_seq = self._peak_blocks(self._model_len_limit()) * self.block_size
            want = self.config.max_num_seqs * per_seq * self.kv_bytes_per_token
            budget = min(CPU_KV_BYTES, want)
        return int(budget // (self.kv_bytes_per_token * self.block_size))

    def _no_kv_block(self) -> str:
        """What to change when the KV pool would hold no block (a setting: ValueError);
        ``num_blocks`` -1: a rank's explicit pool size is more than it has free."""
        nbytes = self.kv_bytes_per_token * self.block_size
        block = f"a block of {self.block_size} tokens takes {nbytes:,} bytes"
        n = self.config.kv_cache_memory_bytes
        if n is not None and self.num_blocks < 0:
            return (f"kv_cache_memory_bytes {n:,} is more than a GPU has free after the "
                    "weights and a step's activations (the log says how much)")  # fmt: skip
        if n is not None:
            return f"kv_cache_memory_bytes {n:,} holds no KV block: {block} here"
        return (f"no memory left for the KV cache ({block}); lower --max-model-len or raise "
                "--gpu-memory-utilization")  # fmt: skip

    def _cuda_kv_budget(self, utilization: float | None) -> int:
        """Device memory the KV pool may take: what ``utilization`` of the total leaves (None:
        all the free memory), less a step's activations."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        mc = self.model.rank_config  # this rank's MLP width; the logits are gathered whole
        tokens = self.config.max_num_batched_tokens
        # activations of the widest step: a few hidden-size and MLP-size buffers per token,
        # plus fp32 logits for up to max_num_seqs rows; doubled for the allocator's slack
        act = tokens * (6 * mc.hidden_size + 3 * mc.intermediate_size) * 4
        act += self.config.max_num_seqs * self.model_config.vocab_size * 4 * 3
        room = free if utilization is None else total * utilization - used
        return int(room - 2 * act)

    def _model_len_limit(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings

    def _peak_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds at once (``peak_blocks``): all of
        them, or when every layer shares a window, those of the window and one step."""
        window = self.model_config.kv_window
        return peak_blocks(num_tokens, self.block_size, window,
                           self.config.max_num_batched_tokens)  # fmt: skip

    def _resolve_max_model_len(self) -> int:
        """The context length: the configured or the model's, lowered to what the KV pool
        holds unless every layer's window lets a longer sequence fit (its old blocks go back
        to the pool as it grows: ``BlockManager.release``)."""
        limit = self._model_len_limit()
        if self.config.max_model_len and limit > self.model_config.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's %d positions",
                           limit, self.model_config.max_position_embeddings)  # fmt: skip
        if self._peak_blocks(limit) > self.num_blocks:
            window = self.model_config.kv_window
            why = f" (less than a {window}-token window plus a step's tokens)" if window else ""
            logger.warning("KV pool holds %d tokens%s: max model len lowered from %d",
                           self.num_kv_tokens, why, limit)  # fmt: skip
            limit = self.num_kv_tokens
        elif limit > self.num_kv_tokens:
            logger.info("every layer has a %d-token window: a sequence holds at most %d KV "
                        "blocks, so max model len %d may exceed the pool's %d tokens",
                        self.model_config.kv_window, self._peak_blocks(limit), limit,
                        self.num_kv_tokens)  # fmt: skip
        return limit

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence]) -> list[SampledToken]:
        """Run one scheduled step over ``seqs`` (decodes first) and wait for it: one sampled
        token for each sequence whose chunk reaches its last token, in the order of ``seqs``."""
        plan = StepPlan.build(seqs, self.block_size)
        out = self._run(plan)
        if out is None:
            return []
        if isinstance(out, torch.Tensor):  # the graph's greedy picks: one device -> host copy
            return _picked(out.tolist(), len(plan.sampling))
        return _to_host(out)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], after: Launched | None = None,
               rows: list[int] | None = None) -> Launched:  # fmt: skip
        """Queue a decode-only step and return without waiting for it. Every row decodes one
        token, without penalties or top logprobs (``Sampler.overlappable``).

        With ``after`` (the step queued before this one, whose tokens the host has not read)
        this is a look-ahead step (``StepPlan.build`` with ``rows``): row i's input token is
        the one ``after`` picks in row ``rows[i]``, gathered on the device."""
        plan = StepPlan.build(seqs, self.block_size, rows if after is not None else None)
        out = self._run(plan, None if after is None else after.picks[0])
        if isinstance(out, torch.Tensor):
            picks = out
        else:
            picks = torch.stack((out.token_ids.double(), out.logprobs.double()))
        if self.device.type != "cuda":
            return Launched(seqs, picks, picks, None)
        landing = self._landing[self._num_launched % 2][: picks.numel()].view(picks.shape)
        self._num_launched += 1
        landing.copy_(picks, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(seqs, picks, landing, done)

    @torch.inference_mode()
    def every_logits(self, seqs: list[Sequence]) -> torch.Tensor:  # [T, V] float32
        """Run one scheduled step over ``seqs`` eagerly, through the normal path (the KV of its
        tokens written to the cache, and read back by the attention), and return the logits of
        every token it computes, in step order; nothing is sampled (teacher forcing:
        ``LLMEngine.prompt_logits``)."""
        plan = StepPlan.build(seqs, self.block_size)
        plan = dataclasses.replace(plan, sample_rows=list(range(len(plan.input_ids))),
                                   eager=True)  # the other ranks' forwards too  # fmt: skip
        upload = self.staging.begin()
        inputs = self.stage(plan, upload)
        upload.send()
        return self._forward(plan, None, None, inputs, None)[0]

    def _run(self, plan: StepPlan, source: torch.Tensor | None = None
             ) -> torch.Tensor | SamplerOutput | None:  # fmt: skip
        """The one launch path: the step's inputs (model, metadata, sampler) in one upload,
        then graph replay or the eager forward, then sampling. Returns the graph's greedy
        picks [2, >= N] float64 when every row is plain greedy under a graph, else the
        sampler's output over the N sampled rows (None: no row samples). ``source``: the input
        ids are indices into it (a look-ahead step)."""
        graphs = self.graphs
        if graphs is None or plan.eager or not graphs.can_run(plan):
            graphs = None
        greedy_in_graph = graphs is not None and Sampler.plain_greedy(plan.sampling)
        upload = (graphs.staging if graphs is not None else self.staging).begin()
        inputs = bucket = None
        if graphs is not None:
            bucket = graphs.stage(plan, upload)
        else:
            inputs = self.stage(plan, upload)
        batch = None
        if plan.sampling and not greedy_in_graph and self.sampler is not None:
            batch = self.sampler.prepare(plan.sampling, ahead=plan.ahead, upload=upload)
        upload.send()
        logits, picks = self._forward(plan, graphs, bucket, inputs, source)
        if greedy_in_graph:
            return picks
        return None if batch is None else self.sampler(logits, batch)

    def _forward(self, plan: StepPlan, graphs, bucket: int | None, inputs: StepInputs | None,
                 source: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        """The staged step's forward (the other ranks told first): its logits, and with a
        graph the greedy picks too. A failure between the ranks' meetings is fatal."""
        try:
            if self.peers is not None:
                self.peers.send(plan)
            if graphs is None:
                return self._forward_eager(plan, inputs, source), None
            if plan.ahead:
                self._ahead_inputs(graphs.input_ids(plan.batch_size), source)
            return graphs.replay(plan.batch_size, bucket)
        except Exception as exc:
            if self.tp.size == 1:
                raise
            why = self.peers.dead_reason(wait=1.0) if self.peers is not None else None
            raise EngineDeadError(why or f"a tensor-parallel step failed after its ranks "
                                  f"started it: {type(exc).__name__}: {exc}") from exc  # fmt: skip

    def _ahead_inputs(self, ids: torch.Tensor, source: torch.Tensor | None) -> None:
        """A look-ahead step's input tokens into ``ids`` (row indices into the step before's
        picks, on rank 0 ``source``): gathered on rank 0's device, then broadcast to the other
        ranks, whose runners never see the picks."""
        if source is not None:
            ids.copy_(source[ids])
        self.tp.broadcast_(ids)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A worker's part of a step that rank 0 runs: the same forward, over this rank's
        shard, sampling nothing."""
        self._run(plan)

    def check_alive(self) -> None:
        """EngineDeadError once a tensor-parallel worker has died."""
        if self.peers is not None:
            self.peers.check_alive()

    def close(self) -> None:
        """Under tensor parallelism: release the CUDA graphs, then stop the workers, if any
        (the graphs first: ``DecodeGraphs.release``). One GPU's graphs go with the process."""
        if self.graphs is not None and self.tp.size > 1:
            self.graphs.release()
            self.graphs = None
        if self.peers is not None:
            self.peers.close()

    def stage(self, plan: StepPlan, upload: Upload) -> StepInputs:
        """An eager step's tensors, added to ``upload`` (usable once it is sent)."""
        ids = upload.add(plan.input_ids, torch.int64)
        positions = upload.add(plan.positions, torch.int64)
        meta = self.backend.prepare_metadata(plan, upload, self.mixed_decode_len)
        rows = None if plan.samples_every_token else upload.add(plan.sample_rows, torch.int64)
        return StepInputs(ids, positions, meta, rows)

    def _forward_eager(self, plan: StepPlan, inputs: StepInputs,
                       source: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """The model without a graph: logits [N, V] fp32 of the sampled rows, None when no
        row samples. ``source``: the input ids are indices into it."""
        if plan.ahead:
            self._ahead_inputs(inputs.input_ids, source)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not plan.sample_rows:
            return None
        if inputs.sample_indices is not None:
            hidden = hidden[inputs.sample_indices]
        return self.model.compute_logits(hidden)


def _picked(picks: list[list[float]], n: int) -> list[SampledToken]:
    """The first ``n`` rows of picks read back as [token ids, logprobs]."""
    ids, logprobs = picks
    return [SampledToken(int(i), lp, None) for i, lp in zip(ids[:n], logprobs[:n])]


def _to_host(out: SamplerOutput) -> list[SampledToken]:
    """One device-to-host transfer for everything the step returns."""
    ids = out.token_ids.tolist()
    lps = out.logprobs.tolist()
    if out.top_ids is None:
        return [SampledToken(i, lp, None) for i, lp in zip(ids, lps)]
    top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
    return [
        SampledToken(i, lp, list(zip(ti, tl))) for i, lp, ti, tl in zip(ids, lps, top_ids, top_lps)
    ]
