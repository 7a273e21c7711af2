"""Which Triton specializations a server meets only after its start-up warm-up: each of them is
a compile in the middle of serving (seconds, every stream stalled) on a GPU.

    python3 docs/benchmarks/compile_kinds.py [FIELD=VALUE ...]   # e.g. kv_cache_dtype=fp8

``max_model_len`` picks the decode graphs' table width. Before ba1961d, at
``max_model_len=1910`` (15 columns of 128-token blocks), their row stride was of another kind
than the eager steps' 16-column tables, as with the 313 columns of ``stall.sh``'s server, and a
mixed step's decodes keyed anew; the graphs' tables now take ``table_columns`` too (16 columns
there), and the default 2,048 gives 16 either way (``docs/benchmarks/serving.md``, sessions
34-35). Run it at ``max_model_len=1910`` to check that it stays so.

Runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which compiles nothing;
each launch's arguments are keyed the way Triton 3.x keys its compiles (a tensor's dtype and
16-byte alignment, an integer's kind: 1, a multiple of 16 or other, unless the kernel lists it
in ``do_not_specialize``; the constexprs' values). An engine on ``dummy:tiny`` with the Triton
backend, 128-token blocks and its warm-up, made to launch what a GPU server launches: the
projections of 1-16 rows go through the weight-streaming GEMV (``kernels.gemv.linear_small_m``,
which only CUDA tensors take otherwise), and before the warm-up each decode-graph bucket's step
runs once as ``DecodeGraphs`` runs it before capturing it. After that the decode-only steps
that a GPU would replay from those graphs run eagerly with their launches not keyed (a replay
compiles nothing); the other steps, those that mix prefill chunks and decodes among them,
launch as on a GPU. Then a few workloads one after another, each new key printed with its
integer arguments' kinds. A measurement tool only; never imported by the engine.
"""

from __future__ import annotations

import collections
import inspect
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import types  # noqa: E402

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import kernels.gemv  # noqa: E402
from flashserve.config import EngineConfig  # noqa: E402
from flashserve.engine import cuda_graph, model_runner  # noqa: E402
from flashserve.engine.llm_engine import LLM  # noqa: E402
from flashserve.sampling.params import SamplingParams  # noqa: E402

KEYS: dict[tuple, str] = {}  # key -> the phase that met it first
PHASE = ["load"]
_run = interpreter.InterpretedFunction.run


def _kind(v, unspecialized: bool, constexpr: bool):
    if constexpr:
        return ("constexpr", str(v))
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or not isinstance(v, int):
        return type(v).__name__
    if unspecialized:
        return "int"
    return 1 if v == 1 else ("x16" if v % 16 == 0 else "int")


def _keyed_run(self, *args, grid, warmup, **kwargs):
    if PHASE[0] == "replay":
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)
    params = inspect.signature(self.fn).parameters
    consts = {n for n, p in params.items() if p.annotation in (tl.constexpr, "tl.constexpr")}
    loose = self.kwargs.get("do_not_specialize") or ()
    loose = {self.arg_names[a] if isinstance(a, int) else a for a in loose}
    bound = {**dict(zip(self.arg_names, args)), **kwargs}
    kinds = {n: _kind(bound[n], n in loose, n in consts) for n in self.arg_names if n in bound}
    options = tuple(sorted((k, str(v)) for k, v in kwargs.items() if k not in self.arg_names))
    key = (self.fn.__name__, tuple(kinds.items()), options)
    if key not in KEYS:
        KEYS[key] = PHASE[0]
        if PHASE[0] not in ("graph capture", "warm-up"):
            ints = {n: k for n, k in kinds.items() if isinstance(bound[n], int) and n not in consts}
            print(f"  new after the warm-up ({PHASE[0]}): {self.fn.__name__} {ints}")
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


_runner_init = model_runner.ModelRunner.__init__


def _runner_init_and_capture(runner, *args, **kwargs) -> None:
    """``ModelRunner.__init__``, then each decode bucket's step as ``DecodeGraphs`` runs it
    before capturing it (its ``_forward`` on the static buffers), largest first; the runner
    keeps the graphs' stand-in for ``_forward_or_replay``, and the length hint that a runner
    with graphs gives its mixed steps' decodes."""
    _runner_init(runner, *args, **kwargs)
    runner.mixed_decode_len = runner.max_model_len
    PHASE[0] = "graph capture"
    buckets, max_blocks, specs = cuda_graph.graph_layout(runner)
    fixed = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    runner.cpu_graphs = types.SimpleNamespace(
        runner=runner, backend=runner.backend, buckets=buckets, max_blocks=max_blocks,
        staging=types.SimpleNamespace(fixed=fixed))  # fmt: skip
    with torch.inference_mode():
        for b in reversed(buckets):
            cuda_graph.DecodeGraphs._forward(runner.cpu_graphs, b)
    PHASE[0] = "warm-up"


_runner_forward = model_runner.ModelRunner._forward


def _forward_or_replay(runner, plan, *args):
    """``ModelRunner._forward``, its launches unkeyed where a GPU replays a decode graph
    (``ModelRunner._run``'s test: not eager, and ``DecodeGraphs.can_run``)."""
    if plan.eager or not cuda_graph.DecodeGraphs.can_run(runner.cpu_graphs, plan):
        return _runner_forward(runner, plan, *args)
    phase, PHASE[0] = PHASE[0], "replay"
    try:
        return _runner_forward(runner, plan, *args)
    finally:
        PHASE[0] = phase


def main() -> None:
    interpreter.InterpretedFunction.run = _keyed_run
    kernels.gemv._streams = kernels.gemv.streamable_shapes  # without its CUDA condition
    model_runner.ModelRunner.__init__ = _runner_init_and_capture
    model_runner.ModelRunner._forward = _forward_or_replay
    PHASE[0] = "warm-up"
    start = time.perf_counter()
    fields = dict(arg.split("=", 1) for arg in sys.argv[1:])  # EngineConfig's
    fields = {k: int(v) if v.isdigit() else v for k, v in fields.items()}
    config = EngineConfig(model="dummy:tiny", device="cpu", dtype="float16",
                          attention_backend="triton", enforce_eager=True, block_size=128,
                          max_kv_tokens=65536, max_num_seqs=32, warm_up=True, **fields)  # fmt: skip
    print("engine options:", fields or "as above")
    llm = LLM(config)
    print(f"engine ready in {time.perf_counter() - start:.0f} s: {len(KEYS)} keys")
    gen = torch.Generator().manual_seed(0)

    def prompts(lens):
        return [torch.randint(5, 200, (n,), generator=gen).tolist() for n in lens]

    sixteen = torch.randint(20, 100, (16,), generator=gen).tolist()
    long = prompts([1900])[0]
    workloads = {
        "a prompt of 12 tokens (a TGI /generate of 'Hello there', BOS and 11 bytes)": prompts([12]),
        "prompts of 3, 5, 9 tokens, one after another": None,
        "one prompt of 40 tokens": prompts([40]),
        "a 1-token prompt": prompts([1]),
        "16 prompts of 20-100 tokens at once": prompts(sixteen),
        "12 prompts of 20-100 tokens at once": prompts(sixteen[:12]),
        "5 prompts of about 300 tokens": prompts([300, 310, 290, 305, 295]),
        "a prompt of 1,900 tokens": [long],
        "200 and 1,900 tokens together (the long one's last chunk beside a decode)": prompts(
            [200, 1900]
        ),
        "the 1,900-token prompt again (its blocks from the prefix cache)": [long],
        "its first 1,024 tokens and 300 new ones": [long[:1024] + prompts([300])[0]],
        "4 prompts sampled (temperature, top-p, top-k, a repetition penalty)": prompts(
            [30, 60, 90, 120]
        ),
    }
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, top_k=50,
                             repetition_penalty=1.1, ignore_eos=True)  # fmt: skip
    for name, batch in workloads.items():
        PHASE[0] = name
        for one in [[p] for p in prompts([3, 5, 9])] if batch is None else [batch]:
            llm.generate(one, sampled if name.endswith("penalty)") else params)
    print("keys by the phase that met them first:", dict(collections.Counter(KEYS.values())))


if __name__ == "__main__":
    main()
