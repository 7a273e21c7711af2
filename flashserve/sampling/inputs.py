"""Host side of the sampler: one step's per-row inputs packed for a single device copy."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from flashserve.engine.sequence import Sequence


class Staging:
    """One reused pinned host buffer for the step's single host -> device copy.

    pin_memory() each step took 4.4 ms once the GPU was busy (new pinned blocks wait on the
    device), and a pageable copy may wait for the stream. With one reused buffer the only wait is
    for the previous step's copy, long finished since that step's tokens were read back.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def upload(self, arrays: list[np.ndarray]) -> torch.Tensor:
        """1-D int64 arrays -> their concatenation on the device, [sum of sizes]."""
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(arrays)).to(self.device)
        n = sum(a.size for a in arrays)
        if self._copied is not None:
            self._copied.synchronize()
        if self._buf.numel() < n:
            self._buf = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        host = self._buf[:n]
        np.concatenate(arrays, out=host.numpy())
        out = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


class Packer:
    """Gathers a step's host arrays (as int64) to send them in one copy."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = np.ascontiguousarray(array, dtype=np.int64)

    def upload(self, staging: Staging) -> dict[str, torch.Tensor]:
        if not self.arrays:
            return {}
        flat = staging.upload([a.ravel() for a in self.arrays.values()])
        parts = flat.split([a.size for a in self.arrays.values()])
        return {n: p.view(a.shape) for (n, a), p in zip(self.arrays.items(), parts)}


def float_bits(rows: list[list[float]]) -> np.ndarray:
    """Columns of floats -> their float32 bit patterns as int64, [C, S]."""
    return np.asarray(rows, dtype=np.float32).reshape(len(rows), -1).view(np.int32)


def as_float(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of float_bits on the device: [C, S] int64 -> [C, S] float32."""
    return bits.to(torch.int32).view(torch.float32)


def pack_sampling(packer: Packer, seqs: list[Sequence], rows: list[int], ahead: int = 0) -> None:
    ps = [seqs[i].params for i in rows]
    if any(p.seed is None for p in ps):
        raise ValueError("every sampled sequence needs params.seed (the engine sets it)")
    packer.add(
        "floats",
        float_bits([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]]),
    )
    steps = [seqs[i].num_tokens + ahead for i in rows]  # the position of each token sampled
    packer.add(
        "ints",
        np.array([[p.top_k for p in ps], [p.seed for p in ps], steps]),
    )
    if len(rows) < len(seqs):
        packer.add("rows", np.array(rows))


def pack_penalties(packer: Packer, seqs: list[Sequence], tokens: TokenArrays) -> bool:
    """Adds penalty inputs when some row uses one; returns whether it did."""
    ps = [s.params for s in seqs]
    rep = [r for r, p in enumerate(ps) if p.repetition_penalty != 1.0]
    out = [r for r, p in enumerate(ps) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep and not out:
        return False
    cols = [
        [p.repetition_penalty for p in ps],
        [p.presence_penalty for p in ps],
        [p.frequency_penalty for p in ps],
    ]
    packer.add("penalty_floats", float_bits(cols))
    arrays = {r: tokens(seqs[r]) for r in sorted(set(rep) | set(out))}
    v = tokens.vocab_size
    if rep:
        packer.add("seen", _flat([arrays[r] for r in rep], rep, v))
    if out:
        outputs = [arrays[r][seqs[r].num_prompt_tokens :] for r in out]
        packer.add("output", _flat(outputs, out, v))
    return True


def _flat(token_arrays: list[np.ndarray], rows: list[int], vocab_size: int) -> np.ndarray:
    """Token ids of the given rows as flat ``row * V + token`` indices, [sum of lengths]."""
    lengths = [len(t) for t in token_arrays]
    offsets = np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, lengths)
    return np.concatenate(token_arrays) + offsets


class TokenArrays:
    """Each sequence's token ids (prompt then output) as int64, extended as tokens are appended.

    Converting a Python list costs ~20 ns a token: ~2 ms a step for one 100K-token prompt under a
    repetition penalty, without this cache. Weakly keyed, so finished sequences drop out.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, seq: Sequence) -> np.ndarray:
        """[num_tokens] int64, a view into the cached buffer."""
        buf, n = self._cache.get(seq, (None, 0))
        total, p = seq.num_tokens, seq.num_prompt_tokens
        if buf is None or not p <= n <= total:
            buf, n = np.empty(2 * total, dtype=np.int64), p
            buf[:p] = seq.prompt_token_ids
        elif total > buf.size:
            buf = np.concatenate([buf[:n], np.empty(2 * total - n, dtype=np.int64)])
        buf[n:total] = seq.output_token_ids[n - p :]
        self._cache[seq] = (buf, total)
        return buf[:total]
