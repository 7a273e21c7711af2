"""What the device can do and what a run used: copy bandwidth, timing, peak memory."""

from __future__ import annotations

import functools
import resource
import statistics
import time

import torch

CUDA_COPY_BYTES = 2 << 30  # 2 GiB source: far past the L2, like kernels/bench.py
CPU_COPY_BYTES = 256 << 20  # 256 MiB: far past the CPU caches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 20) -> float:
    """Bytes/s of a large tensor copy on ``device``, counting bytes read + written: the median
    of ``reps`` copies after a warm-up of as many, timed with CUDA events on a GPU. The reading
    moves by up to 3% from one process to the next on one H100 (2,902-3,007 GB/s in six runs
    within minutes, 2026-11-25, while the decode steps timed beside it moved by 0.2%): compare
    step times between runs, and rooflines only with the bandwidth each run read."""
    if nbytes is None:
        nbytes = CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    src = torch.randn(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(reps):  # clocks up, pages touched
        dst.copy_(src)
    copy = functools.partial(dst.copy_, src)
    times = [timed(copy, device) for _ in range(reps)]
    del copy
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): the CUDA allocator's peak since the last reset, or on the CPU
    the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"


def free_memory(device: torch.device) -> int | None:
    """Free device bytes (CUDA), None on the CPU (no limit checked there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]
