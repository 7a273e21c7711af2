"""``bench decode --profile DIR``: where the time of a decode step goes.

A few decode steps run under the torch profiler after the timed ones; each point leaves a Chrome
trace (open it in Perfetto) and a table of the ops with the most self time, plus the share of the
step's wall time during which the GPU ran kernels (a low share means host work between kernels).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from flashserve.bench.hardware import synchronize

PROFILE_STEPS = 8


def profile_steps(engine, device: torch.device, out_dir: str, name: str) -> dict[str, Any]:
    """Run ``PROFILE_STEPS`` engine steps under the profiler; write ``name``.json (trace) and
    ``name``.txt (table) into ``out_dir``; return a summary."""
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
    return {
        "trace": str(trace),
        "table": str(table_path),
        "wall_us_per_step": wall_us / PROFILE_STEPS,
        "device_us_per_step": device_us / PROFILE_STEPS if cuda else None,
        "gpu_busy_percent": busy,
    }
