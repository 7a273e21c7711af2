"""Per-step message cost between two processes: pyzmq + msgspec vs multiprocessing.Pipe.

The shape of the engine core's traffic: the front end sends a small message (an abort, a new
request), the core answers with one step's outputs for B requests (one token each, a few
characters of text) plus a stats snapshot. Measured per round trip (send, the peer's receive,
encode, send back, receive, decode into objects), and on the core's side alone (building,
encoding and sending one step's message: the time its loop spends per step on IPC).

    python docs/benchmarks/ipc_bench.py [--iters 5000] [--batches 1 8 64]

Results: docs/benchmarks/ipc.md. Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashserve

ITEM = ("abc", 0.25)  # a token's text and logprob


def _outputs_tuples(batch: int, step: int) -> list[tuple]:
    return [(f"req-{i:04d}", [(step % 50000, ITEM[0], -ITEM[1], False, None)], False, None,
             ITEM[0], step, 1234, None, 0) for i in range(batch)]  # fmt: skip


def _outputs_structs(batch: int, step: int):
    from flashserve.engine.messages import EngineStats, StepMessage, WireOutput, WireToken

    token = WireToken(step % 50000, ITEM[0], -ITEM[1], False)
    outs = [WireOutput(f"req-{i:04d}", [token], False, None, ITEM[0], step, 1234, None, 0)
            for i in range(batch)]  # fmt: skip
    return StepMessage(outs, EngineStats(time.monotonic(), batch, 0, 0.5, 0, batch))


# ---- the "core" side, in a spawned process -------------------------------------------------


def _core_pipe(conn, batch: int, iters: int) -> None:
    spent = 0.0
    for step in range(iters):
        conn.recv()
        t0 = time.perf_counter()
        stats = (time.monotonic(), batch, 0, 0.5, 0, batch, None)
        conn.send((_outputs_tuples(batch, step), stats))
        spent += time.perf_counter() - t0
    conn.send(spent / iters)


def _core_zmq(req_path: str, out_path: str, batch: int, iters: int) -> None:
    import zmq

    from flashserve.engine.messages import Codec

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(req_path)
    push.connect(out_path)
    codec = Codec()
    spent = 0.0
    for step in range(iters):
        codec.to_core.decode(pull.recv())
        t0 = time.perf_counter()
        push.send(codec.encode(_outputs_structs(batch, step)))
        spent += time.perf_counter() - t0
    push.send_pyobj(spent / iters)
    push.close(linger=5000)
    pull.close()
    ctx.term()


# ---- the "front end" side ------------------------------------------------------------------


def run_pipe(batch: int, iters: int) -> tuple[list[float], float]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_core_pipe, args=(theirs, batch, iters))
    proc.start()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ours.send(("abort", ["req-0000"]))
        outputs, _stats = ours.recv()
        _ = [o[0] for o in outputs]  # touch the objects, as a consumer would
        times.append(time.perf_counter() - t0)
    core = ours.recv()
    proc.join()
    return times, core


def run_zmq(batch: int, iters: int) -> tuple[list[float], float]:
    import zmq

    from flashserve.engine.messages import Abort, Codec

    tmp = tempfile.mkdtemp()
    req_path, out_path = f"ipc://{tmp}/req", f"ipc://{tmp}/out"
    zctx = zmq.Context()
    push, pull = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    push.bind(req_path)
    pull.bind(out_path)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_core_zmq, args=(req_path, out_path, batch, iters))
    proc.start()
    codec = Codec()
    ping = codec.encode(Abort(["req-0000"]))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        push.send(ping)
        msg = codec.step.decode(pull.recv())
        _ = [o.request_id for o in msg.outputs]
        times.append(time.perf_counter() - t0)
    core = pull.recv_pyobj()
    proc.join()
    push.close()
    pull.close()
    zctx.term()
    return times, core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    import msgspec
    import zmq

    libzmq = zmq.zmq_version()
    versions = f"pyzmq {zmq.__version__} (libzmq {libzmq}), msgspec {msgspec.__version__}"
    print(f"python {sys.version.split()[0]}, {versions}, {os.cpu_count()} CPUs")
    print("| channel | batch | round trip p50 (us) | p99 (us) | mean (us) | core per step (us) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        for name, run in (("multiprocessing.Pipe + pickle", run_pipe),
                          ("pyzmq + msgspec", run_zmq)):  # fmt: skip
            times, core = run(batch, args.iters)
            times = sorted(times[args.iters // 10 :])  # the first tenth warms up
            p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
            print(f"| {name} | {batch} | {p50 * 1e6:.0f} | {p99 * 1e6:.0f} | "
                  f"{statistics.fmean(times) * 1e6:.0f} | {core * 1e6:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
