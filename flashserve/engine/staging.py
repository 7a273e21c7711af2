"""Every host-to-device copy of a step, in one copy from a reused pinned buffer.

A step sends token ids, positions, cache slots, KV lengths, block tables and the sampler's
per-row parameters. They are written into one pinned host buffer and reach the device in one
``copy_``: one launch and one DMA, not one per array (``pin_memory()`` each step cost 4.4 ms
once the GPU was busy; a pageable copy may wait for the stream). ``Staging`` owns the buffer
pair; an ``Upload`` is one step's use of it.

An area is ``[dynamic | fixed]`` in bytes. Fixed tensors (a CUDA graph's static inputs) keep
their addresses for good: ``put`` writes their leading entries. Dynamic arrays (``add``) stack
downwards from the fixed part, so that one copy covers both with no gap: the bytes from the
lowest ``add`` to the end of the last ``put``. A staging without fixed tensors grows when a step
outgrows it (that step copies twice, the next ones once); one with fixed tensors hands what
does not fit to its ``spill`` staging, in a second copy.

The pinned buffer is reused: ``begin`` waits for the previous upload's copy out of it, which on
the engine's one stream ran right after the step before that one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 16  # bytes; every array starts at a multiple, so any dtype views it in place
_DTYPES = (torch.int64, torch.int32, torch.float32)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
Spec = tuple[tuple[int, ...], torch.dtype]  # a fixed tensor: shape, dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Area:
    """A device byte buffer and its (pinned, on CUDA) host twin: ``dynamic`` bytes below the
    fixed tensors of ``specs``, each at an aligned offset, zero to start with."""

    def __init__(self, device: torch.device, dynamic: int, specs: dict[str, Spec]):
        self.anchor = _aligned(dynamic)
        self.offsets: dict[str, int] = {}
        end = self.anchor
        for name, (shape, dtype) in specs.items():
            self.offsets[name] = end
            end += _aligned(math.prod(shape) * dtype.itemsize)
        self.size = max(end, ALIGN)
        pinned = device.type == "cuda"
        self.host = torch.zeros(self.size, dtype=torch.uint8, pin_memory=pinned)
        self.dev = torch.zeros(self.size, dtype=torch.uint8, device=device)
        host = self.host.numpy()
        self._host = {dt: host.view(_NUMPY[dt]) for dt in _DTYPES}  # whole-buffer views
        self._dev = {dt: self.dev.view(dt) for dt in _DTYPES}
        self.fixed = {n: self.view(self.offsets[n], s, dt)[1] for n, (s, dt) in specs.items()}
        self.fixed_host = {n: self.view(self.offsets[n], s, dt)[0] for n, (s, dt) in specs.items()}
        self.copied = torch.cuda.Event() if pinned else None  # recorded after each copy

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        """(host numpy view, device tensor view) of ``shape`` at byte ``offset``."""
        start, n = offset // dtype.itemsize, math.prod(shape)
        host = self._host[dtype][start : start + n].reshape(shape)
        return host, self._dev[dtype][start : start + n].view(shape)

    def wait(self) -> None:
        """Until the last copy out of the host buffer has run: it may be written again."""
        if self.copied is not None:
            self.copied.synchronize()


class Staging:
    """The reused buffers of a stream of uploads, one per step (``begin``).

    ``fixed``: named static device tensors (``self.fixed``) for uploads to ``put`` into;
    ``dynamic``: bytes for ``add``; ``spill``: where adds go that ``dynamic`` cannot hold
    (required with ``fixed``; without it the staging grows instead).
    """

    def __init__(self, device: torch.device | str, dynamic: int = 1 << 16,
                 fixed: dict[str, Spec] | None = None, spill: Staging | None = None):  # fmt: skip
        if fixed and spill is None:
            raise ValueError("a staging with fixed tensors cannot grow: give it a spill")
        self.device = torch.device(device)
        self.spill = spill
        self._area = _Area(self.device, dynamic, fixed or {})
        self._retired: list[_Area] = []  # outgrown, kept until their last copy has run
        self.num_copies = 0  # host-to-device copies since start (tests count them)

    @property
    def fixed(self) -> dict[str, torch.Tensor]:
        return self._area.fixed

    def begin(self) -> Upload:
        """A new upload; waits until the buffer's previous copy has run."""
        self._area.wait()
        for old in self._retired:
            old.wait()
        self._retired.clear()
        return Upload(self)

    def _grow(self, need: int) -> _Area:
        """Swap in an area of at least twice the size with room for ``need`` more bytes."""
        if self.spill is not None or self._area.fixed:
            raise RuntimeError("a staging with fixed tensors does not grow")
        self._retired.append(self._area)
        self._area = _Area(self.device, 2 * (self._area.anchor + need), {})
        return self._area


class Upload:
    """One step's host arrays: ``add`` and ``put`` write them into the pinned buffer now and
    hand back device tensors that hold them once ``send`` has queued the one copy. Kernels
    that read those tensors must be queued (on the same stream) after ``send`` and before the
    staging's next upload is sent, whose copy reuses the same device bytes."""

    def __init__(self, staging: Staging):
        self._staging = staging
        self._area = staging._area
        self._cursor = self._area.anchor  # adds go below it
        self._lo, self._hi = self._area.size, 0  # the bytes written in _area
        self._earlier: list[tuple[_Area, int, int]] = []  # areas outgrown during this upload
        self._spill: Upload | None = None
        self._scatters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fixed dst, dense src)

    def add(self, values: Sequence | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor of ``values`` (a list, 1-D; or an array of any shape)."""
        shape = values.shape if isinstance(values, np.ndarray) else (len(values),)
        host, dev = self._place(shape, dtype)
        host[...] = values
        return dev

    def add_rows(self, rows: Sequence[Sequence[int]], width: int,
                 dtype: torch.dtype = torch.int32) -> torch.Tensor:  # fmt: skip
        """``[len(rows), width]`` on the device: each row then zeros."""
        host, dev = self._place((len(rows), width), dtype)
        _write_rows(host, rows)
        return dev

    def put(self, name: str, values: Sequence) -> None:
        """``values`` into the first ``len(values)`` entries of the 1-D fixed tensor ``name``."""
        host, k = self._area.fixed_host[name], len(values)
        host[:k] = values
        start = self._area.offsets[name]
        self._mark(start, start + k * host.itemsize)

    def put_rows(self, name: str, rows: Sequence[Sequence[int]], width: int) -> None:
        """``rows`` into the top-left ``[len(rows), width]`` of the 2-D fixed tensor ``name``,
        zero padded. The rows' span travels as it is (the tails of the rows before the last
        come along: stale values that a reader stops short of), unless the span is mostly
        tail: then the rows go dense and the device copies them into place."""
        host = self._area.fixed_host[name]
        b, stride = len(rows), host.shape[1]
        span = (b - 1) * stride + width
        if span > 4 * b * width + 4096:
            dense = self.add_rows(rows, width, self._area.fixed[name].dtype)
            self._scatters.append((self._area.fixed[name][:b, :width], dense))
            return
        _write_rows(host[:b, :width], rows)
        start = self._area.offsets[name]
        self._mark(start, start + span * host.itemsize)

    def send(self) -> None:
        """Queue the copies: one per area written (one, unless this step outgrew its staging
        or spilled), then the device-side placement of dense rows."""
        for area, lo, hi in [*self._earlier, (self._area, self._lo, self._hi)]:
            self._copy(area, lo, hi)
        if self._spill is not None:
            self._spill.send()
        for dst, src in self._scatters:
            dst.copy_(src)

    def _copy(self, area: _Area, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        area.dev[lo:hi].copy_(area.host[lo:hi], non_blocking=True)
        if area.copied is not None:
            area.copied.record()
        self._staging.num_copies += 1

    def _place(self, shape: tuple[int, ...], dtype: torch.dtype):
        """Room for ``shape`` below the last add: (host view, device view)."""
        need = _aligned(math.prod(shape) * dtype.itemsize)
        if need > self._cursor:
            return self._overflow(need)._place(shape, dtype)
        self._cursor -= need
        if need:
            self._mark(self._cursor, self._cursor + need)
        return self._area.view(self._cursor, shape, dtype)

    def _overflow(self, need: int) -> Upload:
        """The upload that takes what this area cannot: the spill's, or this one in a larger
        area (what was written here still goes, in its own copy)."""
        if self._staging.spill is not None:
            if self._spill is None:
                self._spill = self._staging.spill.begin()
            return self._spill
        self._earlier.append((self._area, self._lo, self._hi))
        self._area = self._staging._grow(need + self._area.anchor - self._cursor)
        self._cursor = self._area.anchor
        self._lo, self._hi = self._area.size, 0
        return self

    def _mark(self, lo: int, hi: int) -> None:
        self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)


def _write_rows(host: np.ndarray, rows: Sequence[Sequence[int]]) -> None:
    """Each row into ``host`` [B, W], zero padded: O(entries), one conversion per row."""
    for i, row in enumerate(rows):
        n = len(row)
        host[i, :n] = row
        host[i, n:] = 0
