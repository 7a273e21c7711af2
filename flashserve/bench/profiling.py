"""``bench decode --profile DIR``: where the time of a decode step goes.

A few decode steps run under the torch profiler after the timed ones; each point leaves a Chrome
trace (open it in Perfetto), a table of the ops with the most self time, plus the share of the
step's wall time during which the GPU ran kernels (a low share means host work between kernels),
and a table of the GPU kernels by name and grid (``launch_table``): one kernel's launches of
different shapes (a model's four GEMVs) apart, with their calls a step and mean time.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from flashserve.bench.hardware import synchronize

PROFILE_STEPS = 8


def profile_steps(engine, device: torch.device, out_dir: str, name: str) -> dict[str, Any]:
    """Run ``PROFILE_STEPS`` engine steps under the profiler; write ``name``.json (trace),
    ``name``.txt (table) and ``name``-launches.txt (``launch_table``) into ``out_dir``; return a
    summary."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(PROFILE_STEPS):
            engine.step()
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
    header = (
        f"{PROFILE_STEPS} decode steps, {wall_us / PROFILE_STEPS:.1f} us of wall time per step"
        + (f", GPU busy {busy:.1f}% of it" if busy is not None else "")
    )
    table_path.write_text(header + "\n" + events.table(sort_by=sort, row_limit=30) + "\n")
    launches = launch_table(json.loads(trace.read_text()), PROFILE_STEPS)
    (out / f"{name}-launches.txt").write_text(header + "\n" + launches)
    return {
        "trace": str(trace),
        "table": str(table_path),
        "wall_us_per_step": wall_us / PROFILE_STEPS,
        "device_us_per_step": device_us / PROFILE_STEPS if cuda else None,
        "gpu_busy_percent": busy,
    }


def launch_table(trace: dict, steps: int) -> str:
    """The GPU kernels of a Chrome trace (``torch.profiler``'s export) grouped by name and grid,
    most total time first: calls per step, mean, fastest and median µs a call, total µs per
    step, share of the kernels' time. Kernels under the PDL chain span their wait for the
    kernel before them too."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or "dur" not in ev:
            continue
        grid = ev.get("args", {}).get("grid", "")
        groups[(ev.get("name", "?")[:60], str(grid))].append(float(ev["dur"]))
    total = sum(sum(d) for d in groups.values()) or 1.0
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"{'kernel':60s} {'grid':>18s} {'calls/step':>10s} {'mean us':>8s} "
             f"{'min us':>8s} {'median':>8s} {'us/step':>8s} {'%':>5s}"]  # fmt: skip
    for (name, grid), durs in rows:
        lines.append(f"{name:60s} {grid:>18s} {len(durs) / steps:10.1f} "
                     f"{sum(durs) / len(durs):8.2f} {min(durs):8.2f} "
                     f"{statistics.median(durs):8.2f} {sum(durs) / steps:8.1f} "
                     f"{100 * sum(durs) / total:5.1f}")  # fmt: skip
    return "\n".join(lines) + "\n"
