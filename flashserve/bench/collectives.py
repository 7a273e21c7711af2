"""The collectives of one tensor-parallel decode step, timed alone: what ``bench decode`` adds
to its roofline under ``--tensor-parallel-size N``, where the bytes over the bandwidth leave
out the time the ranks spend meeting.

A decode step of batch B calls, in this order (``flashserve/models/decoder.py``,
``flashserve/engine/model_runner.py``): two all-reduces of ``[B, hidden]`` per layer (after o_proj
and down_proj; the embeddings are replicated, so their lookup needs none); the all-gather of the
logits, ``[B, ceil(V / N)]`` float32 a rank; and on a look-ahead step (async scheduling) the
broadcast of its B input ids. ``time_step_collectives`` runs exactly that sequence on N fresh
processes, one per GPU, through the engine's own ``TPGroup`` (NCCL; gloo on the CPU): on CUDA
captured in one CUDA graph and replayed, as the engine replays its decode graph, with nothing else
on the GPUs. It reports rank 0's median time per step over the rounds.

Under ``--tp-all-reduce fused`` the all-reduces after o_proj and down_proj of a step of up to
``kernels.fold.ROWS`` tokens are not collectives (the GEMVs and norms around them do the sums:
``kernels.fold``): the step's collectives are then the gather and the broadcast, and what the
folded sums cost shows in the step's "rest".

Those processes start and end before the engine's own group exists (one torch.distributed
group per process: ``TPGroup``), so ``bench decode`` measures them first.
"""

from __future__ import annotations

import multiprocessing
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashserve.bench.hardware import timed
from flashserve.engine.parallel import TIMEOUT, TPGroup, rank_device
from flashserve.models.config import ModelConfig
from flashserve.models.sharding import RankShape
from kernels.fold import ROWS as FOLD_ROWS

ROUNDS = 15  # timed rounds; each replays the step STEPS times
STEPS = 20
SPAWN_TIMEOUT_S = 300.0  # N processes importing torch and creating their communicators


@dataclass(frozen=True)
class StepCollectives:
    """The collectives of one decode step of a model split over ``size`` ranks."""

    hidden: int
    layers: int
    vocab_rows: int  # a rank's logits columns: ceil(V / N)
    dtype: torch.dtype  # the activations' (the logits are float32)
    size: int
    folded: bool = False  # tp_all_reduce fused: the layers' all-reduces of decode sizes folded

    @classmethod
    def of(cls, config: ModelConfig, size: int, dtype: torch.dtype,
           all_reduce: str = "nccl") -> StepCollectives:  # fmt: skip
        rows = RankShape(config, 0, size).vocab_rows
        return cls(config.hidden_size, config.num_hidden_layers, rows, dtype, size,
                   all_reduce == "fused")  # fmt: skip

    @property
    def all_reduces(self) -> int:
        return 2 * self.layers

    def all_reduces_at(self, batch: int) -> int:
        """The step's all-reduce collectives at ``batch``: none where the layers' are folded
        (``folded``, batch up to ``kernels.fold.ROWS``)."""
        return 0 if self.folded and batch <= FOLD_ROWS else self.all_reduces


def time_step_collectives(
    device: str, shape: StepCollectives, batches: list[int], all_reduce: str = "nccl",
    rounds: int = ROUNDS, steps: int = STEPS,
) -> dict[int, float]:  # fmt: skip
    """Seconds one decode step's collectives take at each batch size: ``shape.size`` spawned
    ranks from ``device`` on (``cuda`` / ``cuda:K``: one GPU each; ``cpu``: gloo), with the
    engine's all-reduce (``EngineConfig.tp_all_reduce``). Raises RuntimeError when a rank
    fails."""
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    store = dist.TCPStore("127.0.0.1", 0, shape.size + 1, is_master=True,
                          wait_for_workers=False, timeout=TIMEOUT)  # fmt: skip
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"flashserve-collectives-{rank}",
                         args=(rank, device, shape, batches, all_reduce, rounds, steps,
                               store.port, results))  # fmt: skip
             for rank in range(shape.size)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=SPAWN_TIMEOUT_S)
    except Exception:  # queue.Empty: a rank hung or died before reporting
        status, payload = "error", "no rank reported within the time limit"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if status != "ok":
        raise RuntimeError(f"timing the tensor-parallel collectives failed: {payload}")
    return payload


def _rank_main(rank: int, device: str, shape: StepCollectives, batches: list[int],
               all_reduce: str, rounds: int, steps: int, port: int, results) -> None:  # fmt: skip
    """One rank: join, time every batch size; rank 0 reports (or any rank's error)."""
    group = None
    try:
        store = dist.TCPStore("127.0.0.1", port, shape.size + 1, is_master=False,
                              timeout=TIMEOUT)  # fmt: skip
        # fused: what is left a collective goes through NCCL (no symmetric memory needed)
        setting = "nccl" if all_reduce == "fused" else all_reduce
        group = TPGroup.join(store, rank, shape.size, rank_device(device, rank), setting)
        times = {b: _time_batch(group, shape, b, rounds, steps) for b in batches}
        if rank == 0:
            results.put(("ok", times))
    except Exception as exc:
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        if group is not None:
            group.destroy()


def _time_batch(group: TPGroup, shape: StepCollectives, batch: int, rounds: int,
                steps: int) -> float:  # fmt: skip
    """Rank ``group.rank``'s median seconds per step at ``batch`` (each round starts at a
    barrier: every rank times the same steps)."""
    dev = group.device
    # zeros: sums stay finite however many steps run (a collective's time does not depend on
    # the values it carries)
    x = torch.zeros(batch, shape.hidden, dtype=shape.dtype, device=dev)
    logits = torch.zeros(batch, shape.vocab_rows, device=dev)
    ids = torch.zeros(batch, dtype=torch.int64, device=dev)

    def step() -> None:
        for _ in range(shape.all_reduces_at(batch)):
            group.all_reduce(x)
        group.gather_last_dim(logits)
        group.broadcast_(ids)

    graph = _graph(step, dev) if dev.type == "cuda" else None
    run = graph.replay if graph is not None else step
    run()  # warm-up (the graph's first replay; gloo's first use)
    per_round = []
    for _ in range(rounds):
        dist.barrier()
        per_round.append(timed(lambda: [run() for _ in range(steps)], dev) / steps)
    if graph is not None:
        graph.reset()  # before the group goes: NCCL's teardown waits for its graphs
    return statistics.median(per_round)


def _graph(step, dev: torch.device) -> torch.cuda.CUDAGraph:
    """``step`` captured in one CUDA graph (after an eager warm-up, on a side stream, as
    ``cuda_graph`` does)."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
