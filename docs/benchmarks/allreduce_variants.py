"""A tensor-parallel decode step's collectives on two GPUs, timed under a CUDA graph: NCCL as
the engine calls it (``flashserve.bench.collectives``, whatever ``NCCL_PROTO`` the environment
sets) against torch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem
.one_shot_all_reduce``, each rank reading the other's buffer over NVLink).

    python docs/benchmarks/allreduce_variants.py nccl            # the engine's collectives
    NCCL_PROTO=LL python docs/benchmarks/allreduce_variants.py nccl
    python docs/benchmarks/allreduce_variants.py one-shot        # 65 one-shot all-reduces

The step is Llama-3-8B's at batch 1 and 8: 65 all-reduces of ``[B, 4096]`` bf16 (``nccl`` also
times the logits' gather and the look-ahead broadcast). Results: ``tensor-parallel.md``. Not a
test: nothing here gates CI.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ALL_REDUCES, HIDDEN, BATCHES = 65, 4096, (1, 8)


def nccl() -> None:
    from flashserve.bench.collectives import StepCollectives, time_step_collectives
    from flashserve.models.presets import preset_config

    shape = StepCollectives.of(preset_config("llama3.1-8b"), 2, torch.bfloat16)
    times = time_step_collectives("cuda", shape, list(BATCHES))
    print("NCCL, ms a step:", {b: round(s * 1e3, 3) for b, s in times.items()})


def _one_shot_rank(rank: int, port: int, results) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=dev)  # fmt: skip
    name = dist.group.WORLD.group_name
    out = {}
    for b in BATCHES:
        buf = symm_mem.empty(b, HIDDEN, dtype=torch.bfloat16, device=dev).zero_()
        symm_mem.rendezvous(buf, name)

        def step(buf=buf) -> None:
            for _ in range(ALL_REDUCES):
                torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rounds = []
        for _ in range(15):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / 20)
        out[b] = round(statistics.median(rounds), 3)
        graph.reset()  # before the group goes (NCCL's teardown waits for captured graphs)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def one_shot() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_one_shot_rank, args=(r, 29555, results)) for r in range(2)]
    for p in procs:
        p.start()
    print(f"one-shot, ms for {ALL_REDUCES} all-reduces:", results.get(timeout=300))
    for p in procs:
        p.join(30)


if __name__ == "__main__":
    {"nccl": nccl, "one-shot": one_shot}[sys.argv[1]]()
