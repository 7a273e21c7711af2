"""``flashserve bench decode``: decode tokens/s of the engine at long context, in process.

For each (context, batch) point the prompts (random token ids) are prefilled first, untimed;
then ``--steps`` decode steps are timed. Each point reports tokens/s, ms per step, the
bandwidth achieved — (weight bytes + KV bytes read per step) / step time — and that as a
percent of the roofline, the same bytes over the copy bandwidth measured in this run. A layer
with a sliding window reads only the KV of its window's positions, and only those count
(Gemma 3: five of six layers read at most 1,024 positions; Mistral v0.1: 4,096). The
peer, Hugging Face transformers (static cache, SDPA) on the same weights, runs after ours
and is held to the same byte count (its static cache in fact attends over the whole masked
cache). Weight bytes are those a step reads: all of them but an untied input embedding, fp8
projections at one byte per weight plus their float32 scales (``weight_bytes_read``). KV
bytes are those of the cache's dtype (``--kv-cache-dtype``): an fp8 cache's one byte a value
plus its scales (``kernels.kv_quant``); the peer keeps its bf16 cache but is held to the same
bytes, so under fp8 its roofline column overstates it (``--no-peer``).

With ``--tensor-parallel-size N`` the bytes and the bandwidth are rank 0's: its share of the
weights (fp8 ones and their scales' share counted as above) and of the KV (its KV heads, in the
cache's dtype, scales included), over its own GPU's copy bandwidth (the N GPUs read in
parallel), plus the time the step's collectives take alone, measured first on the same GPUs
(``flashserve.bench.collectives``: the all-reduces and the logits' gather, replayed in a CUDA
graph). The peer does not run then (transformers holds the whole model on one device).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from typing import Any

import torch

from flashserve.bench import decode_ours as ours_mod
from flashserve.bench.hardware import copy_bandwidth
from flashserve.bench.profiling import PROFILE_STEPS
from flashserve.bench.report import progress, publish, require_matplotlib, run_metadata, table
from flashserve.cli import args as cli
from kernels.common import pdl_chain

logger = logging.getLogger(__name__)


def parse_sizes(text: str) -> list[int]:
    """``"4096,32k,128K"`` -> ``[4096, 32768, 131072]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            value = int(part.removesuffix("k")) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of sizes: {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"sizes must be >= 1: {text!r}")
        out.append(value)
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        type=parse_sizes,
        help="prompt lengths, prefilled untimed (default 4096,32768,131072; 128,512 on CPU)",
    )
    parser.add_argument(
        "--batch",
        type=parse_sizes,
        help="sequences decoding together (default 1,8,32; 1,4 on CPU)",
    )
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per point")
    parser.add_argument("--no-peer", action="store_true", help="skip Hugging Face transformers")
    parser.add_argument(
        "--peer-compile",
        action="store_true",
        help="run the peer's decode through torch.compile (reduce-overhead)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="after each point's timed steps, profile a few more with the torch profiler: "
        "a Chrome trace, the busiest ops and the GPU kernels by name and grid per point in DIR",
    )
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="plot tokens/s against context")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise cli.CLIError("--steps must be >= 1", status=2)
    if args.plot:
        require_matplotlib()
    config = _engine_config(args)
    device = torch.device(config.device)
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.loaders.load import describe_weights

    comm = _time_collectives(config, args)  # before the engine's own group exists
    bandwidth = copy_bandwidth(device)  # before the model takes the memory
    engine = cli.load_engine(LLMEngine, config)
    graphs = engine.runner.graphs is not None  # before the peer frees them
    try:
        points = _run_ours(engine, args)
        peer_info = _run_peer(engine, args, points)
    finally:
        engine.close()
    weights = ours_mod.weight_bytes_read(engine)
    kv_per_token = engine.runner.kv_bytes_per_token
    for p in points:
        _derive(p, weights, bandwidth, comm.get(p["batch"], 0.0))
    result = {
        "meta": {
            **run_metadata(),
            "model": engine.model_name,
            "device": str(device),
            "dtype": config.dtype,
            # their size and dtypes: float8 projections (--quantization fp8, or an fp8
            # checkpoint), with their scales' layout; rank 0's share under tensor parallelism
            "weights": describe_weights(engine.runner.model),
            "kv_cache_dtype": config.kv_cache_dtype,
            "attention_backend": config.attention_backend,
            "cuda_graphs": graphs,
            "async_scheduling": config.async_scheduling,
            "tensor_parallel_size": config.tensor_parallel_size,  # the bytes are rank 0's
            "pdl_chain": pdl_chain(device, config.pdl_chain),  # in effect: sm_90+ only
            "copy_bandwidth_gbs": bandwidth / 1e9,
            # batch -> seconds a step's collectives take alone (tensor parallel; in the roofline)
            "collectives_s_per_step": comm,
            "weight_bytes_read": weights,
            "kv_bytes_per_token": kv_per_token,
            # what decides the longest point that fits: the pool's size, and on CUDA the
            # share of memory it came from (--gpu-memory-utilization)
            "kv_pool_tokens": engine.runner.num_blocks * config.block_size,
            "kv_pool_gib": engine.runner.kv_cache_bytes / 2**30,  # rank 0's, as every rank's
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "steps": args.steps,
            **peer_info,
        },
        "points": points,
    }
    publish(result, format_table(points), args.json)
    if args.plot:
        from flashserve.bench.plots import plot_decode

        plot_decode(result, args.plot)
    return 0


def _engine_config(args: argparse.Namespace):
    cuda = torch.cuda.is_available() and (args.device or "auto") != "cpu"
    if args.model is None:
        args.model = "dummy:llama3-8b" if cuda else "dummy:tiny"
    if args.context is None:
        args.context = [4096, 32768, 131072] if cuda else [128, 512]
    if args.batch is None:
        args.batch = [1, 8, 32] if cuda else [1, 4]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch)
    config = cli.engine_config_from_args(args)
    grid = list(itertools.product(args.context, args.batch))
    need = {(c, b): c + ours_mod.new_tokens_needed(config.max_num_batched_tokens, c, b,
                                                   _our_steps(args))
            for c, b in grid}  # fmt: skip
    if args.max_model_len is None:  # long enough for every point (the KV pool may cap it)
        config.max_model_len = max(need.values())
    if not config.kv_pool_size_given and not config.is_cuda:  # on CUDA: from free memory
        bs = config.block_size
        config.max_kv_tokens = max(b * -(-n // bs) * bs for (_, b), n in need.items())
    return config


def _time_collectives(config, args: argparse.Namespace) -> dict[int, float]:
    """Batch -> seconds of one decode step's collectives on the engine's ranks; {} on one."""
    size = config.tensor_parallel_size
    if size == 1:
        return {}
    from flashserve.bench.collectives import StepCollectives, time_step_collectives
    from flashserve.loaders.load import read_model_config

    shape = StepCollectives.of(read_model_config(config.model), size, config.torch_dtype,
                               config.tp_all_reduce)  # fmt: skip
    return time_step_collectives(config.device, shape, sorted(set(args.batch)),
                                 config.tp_all_reduce)  # fmt: skip


def _our_steps(args: argparse.Namespace) -> int:
    """Decode steps each of our points runs after warm-up: the timed ones, then the profiled."""
    return args.steps + (PROFILE_STEPS if getattr(args, "profile", None) else 0)


def _run_ours(engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(engine.config.seed)
    ctx, bsz = min(args.context), min(args.batch)
    if ours_mod.why_not(engine, ctx, bsz, 2) is None:  # first-use costs, untimed
        ours_mod.measure_ours(engine, ctx, bsz, 2, gen)
    points = []
    grid = list(itertools.product(args.context, args.batch))
    for ctx, bsz in progress(grid, "flashserve", not args.no_progress):
        point: dict[str, Any] = {"context": ctx, "batch": bsz, "status": "ok"}
        point.update(note=ours_mod.why_not(engine, ctx, bsz, _our_steps(args)), ours=None)
        point.update(peer=None, peer_note=None)
        if point["note"] is None:
            try:
                steps = _our_steps(args)
                timing, prof = ours_mod.measure_ours(engine, ctx, bsz, steps, gen, args.profile)
                point["ours"] = vars(timing)
                if prof is not None:
                    point["profile"] = prof
            except torch.cuda.OutOfMemoryError:
                point["note"] = "out of memory"
        if point["note"] is not None:
            point["status"] = "skipped"
            print(f"skipped context {ctx}, batch {bsz}: {point['note']}", file=sys.stderr)
        points.append(point)
    return points


def _run_peer(engine, args: argparse.Namespace, points: list[dict]) -> dict[str, Any]:
    """Measure the peer at every point ours ran; the peer's description for the record."""
    info: dict[str, Any] = {"peer": None, "peer_compile": False, "peer_note": None}
    peer, info["peer_note"] = _make_peer(engine, args)
    if peer is None:  # the reason is in info, once for all points
        return info
    import transformers

    info["peer"] = f"transformers {transformers.__version__}, static cache, sdpa"
    gen = torch.Generator().manual_seed(engine.config.seed)
    todo = [p for p in points if p["status"] == "ok"]
    for p in progress(todo, "transformers", not args.no_progress):
        p["peer"], p["peer_note"] = None, peer.why_not(p["context"], p["batch"], args.steps)
        if p["peer_note"] is None:
            try:
                p["peer"] = vars(peer.measure(p["context"], p["batch"], args.steps, gen))
            except torch.cuda.OutOfMemoryError:
                p["peer_note"] = "out of memory"
                torch.cuda.empty_cache()
    info["peer_compile"] = peer.compiled  # False when asked but torch.compile failed
    if peer.compile_error:
        info["peer_note"] = f"torch.compile failed, eager instead: {peer.compile_error}"
    return info


def _make_peer(engine, args: argparse.Namespace):
    """(the peer, None), or (None, why there is none)."""
    if args.no_peer:
        return None, "--no-peer"
    if engine.config.tensor_parallel_size > 1:
        return None, "tensor parallel: the peer would hold the whole model on one device"
    try:
        from flashserve.bench.decode_peer import Peer, PeerUnavailable
    except ImportError:
        return None, "transformers is not installed"
    ours_mod.release_kv_cache(engine)
    try:
        model, mc = engine.runner.model, engine.model_config
        return Peer(model, mc, engine.max_model_len, args.peer_compile), None
    except PeerUnavailable as exc:
        return None, str(exc)


def _derive(p: dict[str, Any], weights: int, bandwidth: float, comm_s: float = 0.0) -> None:
    """Tokens/s, bandwidth and roofline fields of a measured point (in place). The bytes of
    a step: the weights plus the KV each layer's window reads (``kv_bytes_read``); the
    roofline: those bytes over the bandwidth, plus ``comm_s``, the step's collectives."""
    if p["status"] != "ok":
        return
    bsz = p["batch"]
    step_bytes = weights + p["ours"]["kv_bytes_per_step"]
    roof_step = step_bytes / bandwidth + comm_s
    p["bytes_per_step"] = step_bytes
    p["roofline"] = {
        "ms_per_step": roof_step * 1e3,
        "collectives_ms_per_step": comm_s * 1e3,
        "tokens_per_s_per_seq": 1 / roof_step,
        "tokens_per_s": bsz / roof_step,
    }
    for side in ("ours", "peer"):
        m = p.get(side)
        if m is None:
            continue
        m["ms_per_step"] = m["step_s"] * 1e3
        m["tokens_per_s_per_seq"] = 1 / m["step_s"]
        m["tokens_per_s"] = bsz / m["step_s"]
        m["bandwidth_gbs"] = step_bytes / m["step_s"] / 1e9
        m["roofline_percent"] = 100 * roof_step / m["step_s"]
    peer = p.get("peer")
    p["ours_over_peer"] = peer["step_s"] / p["ours"]["step_s"] if peer else None


HEADERS = ["context", "batch", "tok/s/seq", "tok/s", "ms/step", "GB/s", "% roof",
           "peer tok/s/seq", "peer % roof", "ours/peer", "peak GiB"]  # fmt: skip


def format_table(points: list[dict[str, Any]]) -> str:
    rows, notes = [], []
    for p in points:
        if p["status"] != "ok":
            rows.append([p["context"], p["batch"], "skipped"] + [None] * 8)
            notes.append(f"context {p['context']}, batch {p['batch']}: {p['note']}")
            continue
        if p.get("peer_note"):
            notes.append(f"context {p['context']}, batch {p['batch']}, peer: {p['peer_note']}")
        comm = p["roofline"]["collectives_ms_per_step"]
        if comm:
            notes.append(f"context {p['context']}, batch {p['batch']}: the roofline includes "
                         f"{comm:.3f} ms of collectives a step")  # fmt: skip
        o, q = p["ours"], p.get("peer") or {}
        rows.append([
            p["context"], p["batch"], o["tokens_per_s_per_seq"], o["tokens_per_s"],
            o["ms_per_step"], o["bandwidth_gbs"], o["roofline_percent"],
            q.get("tokens_per_s_per_seq"), q.get("roofline_percent"), p["ours_over_peer"],
            o["peak_memory_bytes"] / 2**30,
        ])  # fmt: skip
    return "\n".join([table(HEADERS, rows), *notes])


DECODE = cli.Command("decode", "decode tokens/s at long context, beside transformers",
                     add_args, run)  # fmt: skip
