"""The one engine configuration object, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kernels.kv_quant import FP8_KV_DTYPE
from kernels.prefill_paths import HOPPER_MIN_PAGE, gluon_triton_refusal
from kernels.prefill_paths import PATHS as PREFILL_PATHS

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("fp8",)
TP_ALL_REDUCES = ("nccl", "auto", "fused")  # tensor parallelism's all-reduce (engine/parallel.py)
# the KV cache's dtype: the model's (auto, or the same dtype named), or fp8 (e4m3 pages with
# per-token scales: kernels.kv_quant); a 16-bit cache under other activations is not a thing
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")
_CANONICAL = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class EngineConfig:
    """Everything the engine needs to start; resolved ("auto") values are filled in here.

    model: a Hugging Face directory, a ``.gguf`` file, ``dummy:<preset>``, or None for the
    embedded default model (SmolLM2-135M-Instruct).
    """

    model: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64  # sequences running at once
    # per-step token budget (chunked prefill). Kept at 2048 on the CPU too: a 6,000-token
    # prefill of the default model on 2 cores takes 20.2 s in 2,048-token chunks, 19.4 s in
    # one 8,192-token step (transformers: 19.0 s), and the chunks let running sequences decode
    # every ~7 s instead of stalling for 20 (docs/benchmarks/cpu-prefill.md)
    max_num_batched_tokens: int = 2048
    max_kv_tokens: int | None = None  # KV pool size in tokens; None: from free memory
    # KV pool size in bytes (each rank's, scales included: an fp8 pool holds about twice the
    # tokens of a bf16 one in the same bytes); None: from free memory (CPU: up to 2 GiB)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    # tokens per KV block; None: 128 where the sm_90 prefill paths run (the triton backend on
    # an H100/H200, a bf16/fp16 cache: time to first token 1.46 -> 1.23 s at 32K and 14.5 ->
    # 10.6 s at 128K, decode unchanged; docs/benchmarks/kernels.md), else 16
    block_size: int | None = None
    attention_backend: str = "auto"  # auto | torch | triton
    # auto (the model's dtype) | bfloat16 | float16 | float32 | fp8: an fp8 cache holds about
    # twice the tokens and halves the KV bytes decode reads; resolved to a name here
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool | None = None  # queue step n+1 before reading step n; None: CUDA
    # chain the decode layer's Triton kernels with programmatic dependent launch (each launched
    # early, waiting in-kernel for the one before it; sm_90+ only); None: on with triton
    pdl_chain: bool | None = None
    # the prefill kernel's path (kernels.prefill_paths.PATHS): portable (FlashAttention-2, every
    # GPU), hopper (bulk tensor copies and persistent programs: sm_90, blocks of >= 64 tokens;
    # bf16/fp16/fp8 caches), gluon (FlashAttention-3 style, warp-specialized: as hopper, plus
    # Triton 3.6, bf16/fp16 models and caches, no windows or soft-caps) or auto (call by call:
    # a few query tiles over a long context: portable over parts of the keys; else gluon where
    # it can run, else hopper where it can, else portable)
    prefill_path: str = "auto"
    # keep the KV blocks of computed prefixes and reuse them for requests that start alike
    # (flashserve.engine.block_manager); off: every request computes its whole prompt
    enable_prefix_caching: bool = True
    # ranks the model is split over (Megatron-style tensor parallelism, one process and one
    # GPU each: cuda:0..N-1, or from cuda:K on; on a CPU every rank shares it, over gloo)
    tensor_parallel_size: int = 1
    # the ranks' all-reduce: nccl, or auto (torch's symmetric-memory one-shot kernel for small
    # bf16/fp32 messages where the ranks share a host and it passes its start-up check, NCCL
    # for the rest: flashserve.engine.parallel). nccl by default: auto measured only 2-2.5%
    # faster decode on two H200s (docs/benchmarks/tensor-parallel.md); fused (two ranks on one
    # host): decode steps' all-reduces folded into the kernels around them (kernels.fold;
    # opt-in, as it rests on torch's private symmetric-memory module like auto)
    tp_all_reduce: str = "nccl"
    # fp8: the decoder's projections in float8 e4m3 with per-channel scales, quantized as the
    # weights load (an fp8 checkpoint is detected from its config.json without it); None:
    # the checkpoint's own (unquantized unless it is an fp8 checkpoint)
    quantization: str | None = None
    seed: int = 0  # seeds dummy weights and unseeded requests' seeds
    # a few requests through the whole path at start-up, before the engine reports ready, so
    # that Triton compiling the kernels the first prompts need is not the first user's wait
    # (on two H200s at TP=2 a first 31K prompt's first token: 10.9 -> 0.7 s); they leave no
    # trace in the pool, the prefix cache, the counters or the seeds (LLMEngine._warm_up).
    # None: on CUDA
    warm_up: bool | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device is cuda but torch sees no CUDA device")
        if self.device.startswith("cuda:") and int(self.device[5:]) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device} does not exist: torch sees "
                             f"{torch.cuda.device_count()} GPU(s)")  # fmt: skip
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        self._resolve_kv_cache_dtype()
        if self.async_scheduling is None:  # on the CPU a step runs at once: nothing to overlap
            self.async_scheduling = self.device.startswith("cuda")
        if self.warm_up is None:  # on the CPU nothing is set up lazily that costs a request
            self.warm_up = self.device.startswith("cuda")
        if self.pdl_chain is None:  # the kernels join it only where the device supports PDL
            self.pdl_chain = self.attention_backend == "triton"
        elif self.pdl_chain and self.attention_backend != "triton":
            raise ValueError("pdl_chain needs the triton attention backend")
        if self.tensor_parallel_size > 1 and self.is_cuda:  # before any query of the GPUs
            self._check_gpus()
        if self.block_size is None:
            self.block_size = self._default_block_size()
        self._check_prefill_path()
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < self.block_size:
            raise ValueError(f"max_kv_tokens must be >= block_size ({self.block_size})")
        if self.kv_cache_memory_bytes is not None:
            if self.max_kv_tokens is not None:
                raise ValueError("give max_kv_tokens or kv_cache_memory_bytes, not both")
            if self.kv_cache_memory_bytes < 1:
                raise ValueError(f"kv_cache_memory_bytes must be >= 1, "
                                 f"got {self.kv_cache_memory_bytes}")  # fmt: skip
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")  # fmt: skip
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(f"tp_all_reduce must be one of {TP_ALL_REDUCES}, "
                             f"got {self.tp_all_reduce!r}")  # fmt: skip
        if self.tp_all_reduce == "fused":  # refused where it cannot run, before any worker
            from flashserve.engine.parallel import check_fused

            check_fused(self)

    def _check_gpus(self) -> None:
        """Enough GPUs on this host for one per rank (under torchrun, each host has its
        own ranks: torchrun checked them)."""
        from flashserve.engine.parallel import missing_gpus, torchrun_env

        if torchrun_env() is not None:
            return
        why = missing_gpus(self.device, self.tensor_parallel_size, torch.cuda.device_count())
        if why:
            raise ValueError(why)

    @property
    def kv_pool_size_given(self) -> bool:
        """The KV pool's size is set (in tokens or bytes), not taken from free memory."""
        return self.max_kv_tokens is not None or self.kv_cache_memory_bytes is not None

    def _default_block_size(self) -> int:
        """128 on an sm_90 GPU with the triton backend where the cache is bf16/fp16 and the
        prefill path is not portable, or the cache is fp8; else 16. Measured on the H100
        (docs/benchmarks/kernels.md and fp8.md): bf16 decode is the same at both (175 / 144 /
        90 tok/s at 4K / 32K / 128K) and the sm_90 prefill paths need pages of >=
        HOPPER_MIN_PAGE; an fp8 cache of 128-token pages is stored a head's rows together
        (``kv_quant.head_major_pages``): decode 176 / 157 / 116 -> 177 / 159 / 119 tok/s, and
        the first token of 128K no later (21.2 -> 20.6 s, 2026-11-27)."""
        sm90_triton = (self.attention_backend == "triton" and self.device.startswith("cuda")
                       and torch.cuda.get_device_capability(self.device)[0] == 9)  # fmt: skip
        if not sm90_triton:
            return 16
        if self.kv_cache_dtype == "fp8":
            return 128
        hopper = self.kv_cache_dtype in ("bfloat16", "float16") and self.prefill_path != "portable"
        return 128 if hopper else 16

    def _check_prefill_path(self) -> None:
        """An explicit hopper or gluon path is refused at start-up where its kernel cannot run
        (what auto would quietly route to the portable path); the model's head dim, windows
        and soft-caps are checked at load (``flashserve.loaders.load``)."""
        path = self.prefill_path
        if path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path must be one of {PREFILL_PATHS}, got {path!r}")
        if path not in ("hopper", "gluon"):
            return
        if self.attention_backend != "triton" or not self.device.startswith("cuda"):
            raise ValueError(f"prefill_path {path} needs the triton backend on a CUDA GPU")
        cap = torch.cuda.get_device_capability(self.device)
        if cap[0] != 9 or (path == "gluon" and cap != (9, 0)):  # Gluon: written for sm_90 itself
            raise ValueError(f"prefill_path {path} needs an sm_90 GPU (H100/H200)")
        if self.block_size < HOPPER_MIN_PAGE:  # a KV tile is one page's run
            raise ValueError(f"prefill_path {path} needs block_size >= {HOPPER_MIN_PAGE}, "
                             f"got {self.block_size}")  # fmt: skip
        if path == "gluon":
            if self.kv_cache_dtype == "fp8":  # the Hopper path takes fp8 caches, Gluon not
                raise ValueError("prefill_path gluon takes bf16/fp16 KV caches, not fp8")
            if self.torch_dtype == torch.float32:
                raise ValueError("prefill_path gluon takes bf16/fp16 models, not float32")
            import triton

            why = gluon_triton_refusal(triton.__version__)
            if why:
                raise ValueError(f"prefill_path gluon: {why}")

    def _resolve_kv_cache_dtype(self) -> None:
        """``kv_cache_dtype``: auto becomes the model's dtype; aliases (bf16, fp16, ...) their
        name; refused: unknown names, a 16/32-bit cache in another dtype than the model's, and
        fp8 under the Triton kernels on a GPU without e4m3 conversions (before sm_89)."""
        kv = self.kv_cache_dtype
        if kv == "auto":
            kv = self.dtype
        if kv != "fp8":
            if kv not in _DTYPES:
                raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")  # fmt: skip
            kv = _CANONICAL[_DTYPES[kv]]
            if _DTYPES[kv] != self.torch_dtype:
                raise ValueError(f"kv_cache_dtype {kv} differs from dtype {self.dtype}: the KV "
                                 "cache is in the model's dtype (auto) or fp8")  # fmt: skip
        elif self.attention_backend == "triton" and self.device.startswith("cuda"):
            cap = torch.cuda.get_device_capability(self.device)
            if cap < (8, 9):
                raise ValueError(f"kv_cache_dtype fp8 needs a GPU with e4m3 conversions (sm_89+, "
                                 f"Ada or Hopper) for the triton backend; this one is sm_"
                                 f"{cap[0]}{cap[1]}")  # fmt: skip
        self.kv_cache_dtype = kv

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV pools' dtype: the model's, or ``float8_e4m3fn`` (with scale pools)."""
        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8" else _DTYPES[self.kv_cache_dtype]

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
