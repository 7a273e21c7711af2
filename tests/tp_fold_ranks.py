"""Two ranks on two GPUs running the folded all-reduce's kernels (``kernels.fold``) through the
engine's own group (``TPGroup.join(..., "fused")``: symmetric memory, its start-up check),
for tests/test_tp_fold_gpu.py: ``python tests/tp_fold_ranks.py OUT.json`` spawns both ranks
and writes each one's findings ({rank: {"status", "report"}}).

Each rank runs a sequence of folded calls (its GEMV, then the add-norm that waits for the
other rank's part), Llama's and Gemma's norms alternating, several row counts and tile
configs (split K among them), bf16; after each call it sums its GEMV's own output with NCCL
and runs the unfolded norm on that: the folded results must be those, bit for bit. Rank 1
is held back (``torch.cuda._sleep``, tens of milliseconds) before some of its GEMVs, so that
rank 0's norm must wait. Then the same under a CUDA graph (four calls captured, rank 1's
sleep inside, replayed over new inputs), and the status word must read 0 (no norm gave up).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashserve.engine.parallel import TPGroup  # noqa: E402
from kernels.gemv import linear_small_m  # noqa: E402
from kernels.norm import add_rms_norm, norm_add_norm  # noqa: E402

EPS = 1e-6
SLEEP_CYCLES = 50_000_000  # ~25-35 ms at the H100/H200's clocks
# (rows, hidden, K, tile config or None for the heuristic's, Gemma's form)
CALLS = [(1, 4096, 2048, None, False), (5, 4096, 7168, None, False), (16, 3840, 1920, None, True),
         (1, 4096, 2048, (4, 1024, 4, 4, 3), False), (3, 3840, 7680, None, True),
         (1, 4096, 7168, None, False), (8, 4096, 2048, (32, 256, 2, 4, 4), True)]  # fmt: skip
HELD = {1, 4, 5}  # calls before whose GEMV rank 1 sleeps


def inputs(call: int, rank: int, m: int, h: int, k: int, dev: torch.device, gemma: bool):
    """This rank's x and weight (its own), and the residual and norm weights (both ranks')."""
    mine = torch.Generator(device=dev).manual_seed(1000 * call + rank)
    both = torch.Generator(device=dev).manual_seed(1000 * call + 7)
    bf = torch.bfloat16
    x = torch.randn(m, k, device=dev, generator=mine).to(bf)
    w = (torch.randn(h, k, device=dev, generator=mine) / k**0.5).to(bf)
    res = torch.randn(m, h, device=dev, generator=both).to(bf)
    norm_w = (1 + 0.1 * torch.randn(h, device=dev, generator=both)).to(bf)
    post_w = (0.1 * torch.randn(h, device=dev, generator=both)).to(bf) if gemma else None
    return x, w, res, norm_w, post_w


def folded(x, w, res, norm_w, post_w, fold, config, hold: bool):
    if hold:
        torch.cuda._sleep(SLEEP_CYCLES)
    out = linear_small_m(x, w, fold=fold, config=config)
    if post_w is not None:
        return out, norm_add_norm(out, res, post_w, norm_w, EPS, True, fold=fold)
    return out, add_rms_norm(out, res, norm_w, EPS, fold=fold)


def unfolded(out, res, norm_w, post_w):
    """The engine's NCCL path on the same GEMV output: all-reduce, then the plain kernel."""
    summed = out.clone()
    dist.all_reduce(summed)
    if post_w is not None:
        return norm_add_norm(summed, res, post_w, norm_w, EPS, True)
    return add_rms_norm(summed, res, norm_w, EPS)


def differences(got, want) -> list[str]:
    return [name for name, a, b in zip(("normed", "residual"), got, want, strict=True)
            if not torch.equal(a, b)]  # fmt: skip


def rank_main(rank: int, port: int, results) -> None:
    group = None
    try:
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=False)
        group = TPGroup.join(store, rank, 2, f"cuda:{rank}", "fused")
        dev = group.device
        report = {"eager": [], "graph": []}
        for call, (m, h, k, config, gemma) in enumerate(CALLS):
            x, w, res, norm_w, post_w = inputs(call, rank, m, h, k, dev, gemma)
            fold = group.fused.fold(h, torch.bfloat16)
            out, got = folded(x, w, res, norm_w, post_w, fold, config,
                              rank == 1 and call in HELD)  # fmt: skip
            bad = differences(got, unfolded(out, res, norm_w, post_w))
            report["eager"].append({"call": call, "rows": m, "hidden": h, "differ": bad})
        report["graph"] = graph_calls(group, rank)
        torch.cuda.synchronize(dev)
        report["status"] = group.fused.status.item()
        report["calls"] = group.fused.calls.item()
        results.put((rank, "ok", report))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if group is not None:
            group.destroy()


def graph_calls(group: TPGroup, rank: int) -> list[dict]:
    """Four folded calls captured in one CUDA graph (rank 1 sleeping before the second),
    replayed three times over new inputs copied into the captured ones."""
    dev = group.device
    shapes = [CALLS[i] for i in (0, 2, 1, 6)]
    fold = {h: group.fused.fold(h, torch.bfloat16) for _, h, _, _, _ in shapes}
    static = [inputs(100 + i, rank, m, h, k, dev, g) for i, (m, h, k, _, g) in enumerate(shapes)]

    def step():
        return [folded(*static[i], fold[s[1]], s[3], rank == 1 and i == 1)
                for i, s in enumerate(shapes)]  # fmt: skip

    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles, allocates the split counters
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream(dev).wait_stream(stream)
    found = []
    for replay in range(3):
        for i, (m, h, k, _, g) in enumerate(shapes):
            for dst, src in zip(static[i], inputs(200 + 10 * replay + i, rank, m, h, k, dev, g),
                                strict=True):  # fmt: skip
                if dst is not None:
                    dst.copy_(src)
        graph.replay()
        for i, (out, got) in enumerate(captured):
            _, _, res, norm_w, post_w = static[i]
            bad = differences(got, unfolded(out, res, norm_w, post_w))
            found.append({"replay": replay, "call": i, "differ": bad})
    graph.reset()
    return found


def main(path: str) -> int:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=rank_main, args=(r, store.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = {}
    try:
        for _ in range(2):
            rank, status, payload = results.get(timeout=240)
            ranks[rank] = {"status": status, "report": payload}
    except Exception:  # queue.Empty: a rank hung or died
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    with open(path, "w") as f:
        json.dump(ranks, f)
    return 0 if len(ranks) == 2 and all(r["status"] == "ok" for r in ranks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
