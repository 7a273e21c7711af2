"""``bench decode --profile DIR`` and ``bench prefill --profile DIR``: where the time of a
decode step, or of a prompt's first token, goes.

A few decode steps (or one more prefill) run under the torch profiler after the timed ones;
each point leaves a Chrome trace (open it in Perfetto), a table of the ops with the most self
time, plus the share of the wall time during which the GPU ran kernels (a low share means host
work between kernels), and a table of the GPU kernels by name and grid (``launch_table``): one
kernel's launches of different shapes (a model's four GEMVs) apart, with their calls a step
and mean time.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from flashserve.bench.hardware import synchronize

PROFILE_STEPS = 8


def profile_steps(engine, device: torch.device, out_dir: str, name: str) -> dict[str, Any]:
    """Run ``PROFILE_STEPS`` engine steps under the profiler (``profile_run``)."""

    def steps() -> None:
        for _ in range(PROFILE_STEPS):
            engine.step()

    return profile_run(steps, device, out_dir, name, PROFILE_STEPS, "decode steps", "step")


def profile_run(
    work: Callable[[], object], device: torch.device, out_dir: str, name: str, times: int,
    what: str, unit: str,
) -> dict[str, Any]:  # fmt: skip
    """Run ``work`` (``times`` of ``what``, each a ``unit``: 8 "decode steps" of a "step", or
    1 "prefill") under the profiler; write ``name``.json (trace), ``name``.txt (table) and
    ``name``-launches.txt (``launch_table``, per ``unit``) into ``out_dir``; return a summary
    (times per ``unit``)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        work()
        synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace, table_path = out / f"{name}.json", out / f"{name}.txt"
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    busy = 100.0 * device_us / wall_us if cuda else None
    header = f"{times} {what}, {wall_us / times:.1f} us of wall time per {unit}" + (
        f", GPU busy {busy:.1f}% of it" if busy is not None else ""
    )
    table_path.write_text(header + "\n" + events.table(sort_by=sort, row_limit=30) + "\n")
    launches = launch_table(json.loads(trace.read_text()), times, unit)
    (out / f"{name}-launches.txt").write_text(header + "\n" + launches)
    return {
        "trace": str(trace),
        "table": str(table_path),
        "launches": str(out / f"{name}-launches.txt"),
        f"wall_us_per_{unit}": wall_us / times,
        f"device_us_per_{unit}": device_us / times if cuda else None,
        "gpu_busy_percent": busy,
    }


def launch_table(trace: dict, steps: int, unit: str = "step") -> str:
    """The GPU kernels of a Chrome trace (``torch.profiler``'s export) grouped by name and grid,
    most total time first: calls per step (``steps`` of them, each a ``unit``: a decode step,
    a prefill), mean, fastest and median µs a call, total µs per step, share of the kernels'
    time. Kernels under the PDL chain span their wait for the kernel before them too."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or "dur" not in ev:
            continue
        grid = ev.get("args", {}).get("grid", "")
        groups[(ev.get("name", "?")[:60], str(grid))].append(float(ev["dur"]))
    total = sum(sum(d) for d in groups.values()) or 1.0
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"{'kernel':60s} {'grid':>18s} {'calls/' + unit:>10s} {'mean us':>8s} "
             f"{'min us':>8s} {'median':>8s} {'us/' + unit:>8s} {'%':>5s}"]  # fmt: skip
    for (name, grid), durs in rows:
        lines.append(f"{name:60s} {grid:>18s} {len(durs) / steps:10.1f} "
                     f"{sum(durs) / len(durs):8.2f} {min(durs):8.2f} "
                     f"{statistics.median(durs):8.2f} {sum(durs) / steps:8.1f} "
                     f"{100 * sum(durs) / total:5.1f}")  # fmt: skip
    return "\n".join(lines) + "\n"
