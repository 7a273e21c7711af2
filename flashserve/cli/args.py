"""What every command shares: the ``Command`` record, ``CLIError``, the engine's options and
loading an engine from them (``generate``, the bench commands and the server's ``serve``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from flashserve.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    PREFILL_PATHS,
    QUANTIZATIONS,
    TP_ALL_REDUCES,
    EngineConfig,
)

T = TypeVar("T")


class Command(NamedTuple):
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CLIError(Exception):
    """A message for the user and the exit status: 2 for bad arguments, 1 for a failure."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig fields as options; defaults (None) leave EngineConfig's own."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="a Hugging Face directory, a .gguf file or dummy:<preset> "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument(
        "--dtype",
        help="auto (default: bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16",
    )
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    g.add_argument(
        "--max-kv-tokens",
        type=int,
        help="KV cache size in tokens (default: from --gpu-memory-utilization)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="KV cache size in bytes, each GPU's (instead of --max-kv-tokens; default: from "
        "--gpu-memory-utilization, on a CPU up to 2 GiB)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="share of the GPU's memory the engine may fill: the weights, a step's "
        "activations and the KV cache, which gets the rest (default: "
        f"{EngineConfig.gpu_memory_utilization:.2f})",
    )
    g.add_argument("--block-size", type=int, help="tokens per KV cache block (a power of two; "
                   "default 128 with the triton backend on an H100/H200 for an fp8 cache, and "
                   "for a bf16/fp16 one unless --prefill-path portable; else 16)")  # fmt: skip
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS)
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="fp8: quantize the decoder's projections to float8 e4m3 as they load, one scale "
        "per output channel (half the weight bytes; embeddings and LM head stay in --dtype). "
        "fp8 checkpoints (compressed-tensors, or 128x128 block scales) load as they are, "
        "without this option",
    )
    g.add_argument(
        "--kv-cache-dtype",
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="the KV cache's dtype: auto (default: the model's --dtype) or fp8 (e4m3 with a "
        "scale per token and KV head: about twice the tokens in the same memory, half the KV "
        "bytes read per decode step)",
    )
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each decode step on the device before the host has read the one "
        "before it, hiding the host's work between steps (steps with penalties or logprobs "
        "run plainly); default: on with CUDA",
    )
    g.add_argument(
        "--prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the KV cache blocks of computed prompts and reuse them for later requests "
        "that start with the same tokens (default: on)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="split the model over N ranks, one process and one GPU each (cuda:0..N-1): "
        "attention heads, MLP and vocabulary; NCCL on CUDA, gloo on a CPU (default: 1). "
        "Across hosts: run the same command under torchrun on each (README)",
    )
    g.add_argument(
        "--tp-all-reduce",
        choices=TP_ALL_REDUCES,
        help="the tensor-parallel ranks' all-reduce: nccl (default), auto (torch's "
        "symmetric-memory one-shot kernel for small bf16/fp32 messages where the ranks share "
        "a host, NCCL for the rest: decode 2-2.5%% faster than with NCCL on two H200s; not the "
        "default: README), or fused (two ranks on one host, CUDA, triton backend: decode "
        "steps' all-reduces folded into the row-parallel GEMVs and the norms after them: "
        "decode at batch 1 1.60x one GPU's at 32K and 1.73x at 128K on two H200s; opt-in, "
        "as it rests on torch's private symmetric-memory module like auto)",
    )
    g.add_argument(
        "--prefill-path",
        choices=PREFILL_PATHS,
        help="the Triton prefill kernel: auto (default: a few query tiles over a long context "
        "on the portable kernel over parts of the keys; else gluon where it can run, else "
        "hopper where it can, else portable), portable (every GPU), hopper (TMA copies and "
        "persistent programs; sm_90 with --block-size 64 or more, bf16/fp16 KV, head dims "
        "64/128/256), gluon (FlashAttention-3 style, warp-specialized; as hopper, plus Triton "
        "3.6, bf16/fp16 models, no sliding windows or soft-capping; best at --block-size 128)",
    )
    g.add_argument(
        "--pdl-chain",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each of a decode layer's Triton kernels early, waiting in-kernel for the "
        "one before it (programmatic dependent launch, sm_90+): 2-3%% faster decode at batch "
        "1; default: on with the triton backend",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    try:
        return EngineConfig(**given)
    except ValueError as exc:
        raise CLIError(str(exc), status=2) from exc


def load_engine(factory: Callable[[EngineConfig], T], config: EngineConfig) -> T:
    """Build an engine (``LLM``, ``AsyncLLM``); a model that cannot be loaded is a CLIError.
    A tensor-parallel rank > 0 under torchrun serves rank 0 instead, and exits."""
    serve_if_torchrun_worker(config)
    try:
        return factory(config)
    except (OSError, ValueError) as exc:
        raise model_error(config, exc) from exc


def model_error(config: EngineConfig, exc: BaseException) -> CLIError:
    """The one line for a model that cannot be loaded: the model, then the problem (once: a
    ``WeightsError`` already starts with the file, which may be the model's path)."""
    text = str(exc)
    if config.model and text.startswith(config.model):
        return CLIError(f"cannot load the model: {text}")
    return CLIError(f"cannot load the model {config.model or '(default)'}: {text}")


def serve_if_torchrun_worker(config: EngineConfig) -> None:
    """Under torchrun every rank runs the same command; on ranks > 0 it only serves rank 0's
    steps (``flashserve.engine.tp_worker``) until rank 0 stops, then exits."""
    from flashserve.engine.parallel import torchrun_env

    env = torchrun_env()
    if config.tensor_parallel_size > 1 and env is not None and env.rank > 0:
        from flashserve.engine.tp_worker import serve_torchrun

        raise SystemExit(serve_torchrun(config))
