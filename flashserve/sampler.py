"""Token sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded noise.

A sampled row picks ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry (the exponential
race, i.e. Gumbel-max): that is an exact draw from ``p``. ``E`` comes from a counter-based hash
of (row seed, row step, vocab index) made of integer tensor ops, so a row's token depends only on
its own logits, seed and step: not on the other rows, the batch order or any generator state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from flashserve.sampling_noise import exponential_noise, hash32_
from flashserve.sequence import Sequence

# Temperatures below this sample greedily: dividing by them can overflow float32 (1e2 / 1e-37 is
# inf), and at 1e-5 a logit gap of 1e-3 is already a factor e**100 between probabilities.
_MIN_TEMPERATURE = 1e-5


@dataclass
class Penalties:
    """Per-row penalty inputs for all N rows; indices are flat ``row * V + token``."""

    repetition: torch.Tensor  # [N] float32, 1.0 off
    presence: torch.Tensor  # [N] float32, 0.0 off
    frequency: torch.Tensor  # [N] float32, 0.0 off
    seen_index: torch.Tensor | None  # [P] int64: prompt + output tokens, rows with repetition
    output_index: torch.Tensor | None  # [O] int64: output tokens (one entry per occurrence)


@dataclass
class SamplingBatch:
    """Device tensors for one step's N sampling rows, of which S sample (the rest are greedy)."""

    num_seqs: int
    num_sampled: int
    sample_rows: torch.Tensor | None  # [S] int64 row indices; None when S == N (or S == 0)
    temperature: torch.Tensor | None  # [S] float32, > 0
    top_p: torch.Tensor | None  # [S] float32, 1.0 off
    min_p: torch.Tensor | None  # [S] float32, 0.0 off
    top_k: torch.Tensor | None  # [S] int64, <= 0 off
    seed: torch.Tensor | None  # [S] int64
    step: torch.Tensor | None  # [S] int64: position of the token being sampled
    max_top_k: int  # largest enabled top_k among sampled rows (capped at V); 0: nobody uses it
    use_top_p: bool
    use_min_p: bool
    penalties: Penalties | None  # None: no row uses a penalty
    max_logprobs: int  # K of the top-logprobs output; 0: nobody asked


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: raw log-softmax at the chosen token
    top_ids: torch.Tensor | None  # [N, K] int64, best first
    top_logprobs: torch.Tensor | None  # [N, K] float32


class _Packer:
    """Gathers host arrays into one int64 buffer: one host -> device copy per step."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = np.ascontiguousarray(array, dtype=np.int64)

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.arrays:
            return {}
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in self.arrays.values()]))
        if device.type == "cuda":
            flat = flat.pin_memory()  # the caching host allocator keeps it alive for the copy
        parts = flat.to(device, non_blocking=True).split([a.size for a in self.arrays.values()])
        return {n: p.view(a.shape) for (n, a), p in zip(self.arrays.items(), parts)}


def _float_bits(rows: list[list[float]]) -> np.ndarray:
    """Columns of floats -> their float32 bit patterns as int64, [C, S]."""
    return np.asarray(rows, dtype=np.float32).reshape(len(rows), -1).view(np.int32)


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of _float_bits on the device: [C, S] int64 -> [C, S] float32."""
    return bits.to(torch.int32).view(torch.float32)


def _is_greedy(seq: Sequence) -> bool:
    return seq.params.temperature < _MIN_TEMPERATURE


def _pack_sampling(packer: _Packer, seqs: list[Sequence], rows: list[int]) -> None:
    ps = [seqs[i].params for i in rows]
    if any(p.seed is None for p in ps):
        raise ValueError("every sampled sequence needs params.seed (the engine sets it)")
    packer.add(
        "floats",
        _float_bits([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]]),
    )
    packer.add(
        "ints",
        np.array([[p.top_k for p in ps], [p.seed for p in ps], [seqs[i].num_tokens for i in rows]]),
    )
    if len(rows) < len(seqs):
        packer.add("rows", np.array(rows))


def _pack_penalties(packer: _Packer, seqs: list[Sequence], tokens: _TokenArrays) -> bool:
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
    packer.add("penalty_floats", _float_bits(cols))
    v = tokens.vocab_size
    if rep:
        packer.add("seen", _flat([tokens(seqs[r]) for r in rep], rep, v))
    if out:
        outputs = [tokens(seqs[r])[seqs[r].num_prompt_tokens :] for r in out]
        packer.add("output", _flat(outputs, out, v))
    return True


def _flat(token_arrays: list[np.ndarray], rows: list[int], vocab_size: int) -> np.ndarray:
    """Token ids of the given rows as flat ``row * V + token`` indices, [sum of lengths]."""
    return np.concatenate([t + r * vocab_size for t, r in zip(token_arrays, rows)])


class _TokenArrays:
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


def apply_penalties(logits: torch.Tensor, pen: Penalties | None) -> torch.Tensor:
    """Repetition (CTRL / HF), then presence and frequency (OpenAI) penalties: [N, V] -> [N, V].

    Repetition, over prompt + output tokens: positive logits are divided by r, negative ones
    multiplied. Presence and frequency, over output tokens: l -= presence * (count > 0) +
    frequency * count. Returns a new tensor; ``logits`` is left as it is.
    """
    if pen is None:
        return logits
    n, v = logits.shape
    out = logits
    if pen.seen_index is not None:
        seen = torch.zeros(n * v, dtype=torch.bool, device=logits.device)
        seen = seen.index_fill_(0, pen.seen_index, True).view(n, v)
        r = pen.repetition.unsqueeze(1)
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if pen.output_index is not None:
        ones = torch.ones_like(pen.output_index, dtype=torch.float32)
        counts = torch.zeros(n * v, device=logits.device).index_add_(0, pen.output_index, ones)
        counts = counts.view(n, v)
        out = out - (pen.frequency.unsqueeze(1) * counts + pen.presence.unsqueeze(1) * (counts > 0))
    return out


def _top_k_top_p(scaled: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Sets to -inf the logits outside each row's top-k and then its nucleus: [S, V] -> [S, V].

    Each filter becomes a per-row cut on the logit value, so tokens tied at the cut are kept.
    The nucleus is the smallest prefix (by descending prob) whose mass reaches top_p: a token is
    kept when the mass strictly before it is < top_p, so the best token always is.
    """
    v = scaled.size(1)
    if b.use_top_p:
        ranked = scaled.sort(dim=-1, descending=True).values  # [S, V]
    else:
        ranked = scaled.topk(b.max_top_k, dim=-1).values  # [S, max_top_k]
    k = torch.where(b.top_k > 0, b.top_k.clamp(max=v), v)  # [S]
    k_cut = ranked.gather(1, (k - 1).clamp(max=ranked.size(1) - 1).unsqueeze(1))  # [S, 1]
    cut = torch.where((k < v).unsqueeze(1), k_cut, float("-inf"))
    if b.use_top_p:
        positions = torch.arange(v, device=scaled.device)
        ranked = ranked.masked_fill(positions >= k.unsqueeze(1), float("-inf"))
        cum = ranked.softmax(dim=-1).cumsum(dim=-1)
        before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # exclusive cumsum, monotone
        kept = (before < b.top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)  # [S, 1], >= 1
        p_cut = ranked.gather(1, kept - 1)
        p_cut = torch.where(b.top_p.unsqueeze(1) < 1.0, p_cut, float("-inf"))
        cut = torch.maximum(cut, p_cut)
    return scaled.masked_fill(scaled < cut, float("-inf"))


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes probs below min_p * the row's max prob: [S, V], [S] -> [S, V] (not renormalised)."""
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < floor, 0.0)


class Sampler:
    """Picks one token per row on the device; see the module docstring for the method."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=self.device)
        self._vocab_hash = hash32_(vocab)  # [V]
        self._tokens = _TokenArrays(vocab_size)

    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        """Host -> device, in one copy: per-row parameters and, if used, penalty histories."""
        sampled = [i for i, s in enumerate(seqs) if not _is_greedy(s)]
        packer = _Packer()
        if sampled:
            _pack_sampling(packer, seqs, sampled)
        has_penalties = _pack_penalties(packer, seqs, self._tokens)
        t = packer.upload(self.device)
        ps = [seqs[i].params for i in sampled]
        floats = _as_float(t["floats"]) if sampled else [None] * 3
        ints = t["ints"] if sampled else [None] * 3
        return SamplingBatch(
            num_seqs=len(seqs),
            num_sampled=len(sampled),
            sample_rows=t.get("rows"),
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=ints[0],
            seed=ints[1],
            step=ints[2],
            max_top_k=max((p.top_k for p in ps if 0 < p.top_k < self.vocab_size), default=0),
            use_top_p=any(p.top_p < 1.0 for p in ps),
            use_min_p=any(p.min_p > 0.0 for p in ps),
            penalties=_unpack_penalties(t) if has_penalties else None,
            max_logprobs=max((s.params.logprobs or 0 for s in seqs), default=0),
        )

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] float32 -> one token per row, with raw logprobs."""
        if logits.shape != (batch.num_seqs, self.vocab_size):
            raise ValueError(
                f"logits {tuple(logits.shape)} != ({batch.num_seqs}, {self.vocab_size})"
            )
        raw = logits
        logits = apply_penalties(logits, batch.penalties)
        if batch.num_sampled == batch.num_seqs > 0:
            token_ids = self._sample(logits, batch)
        else:
            token_ids = logits.argmax(dim=-1)
            if batch.num_sampled:
                rows = batch.sample_rows
                token_ids.index_copy_(0, rows, self._sample(logits.index_select(0, rows), batch))
        return _with_logprobs(raw, token_ids, batch.max_logprobs)

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Sampled rows' penalised logits [S, V] -> token ids [S]."""
        scaled = logits / b.temperature.unsqueeze(1)
        if b.max_top_k or b.use_top_p:
            scaled = _top_k_top_p(scaled, b)
        probs = scaled.softmax(dim=-1)
        if b.use_min_p:
            probs = _min_p(probs, b.min_p)
        return probs.div_(exponential_noise(b.seed, b.step, self._vocab_hash)).argmax(dim=-1)


def _unpack_penalties(t: dict[str, torch.Tensor]) -> Penalties:
    floats = _as_float(t["penalty_floats"])
    return Penalties(floats[0], floats[1], floats[2], t.get("seen"), t.get("output"))


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    """Raw logits [N, V] and chosen ids [N] -> output with log-softmax values of the raw logits."""
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if not k:
        return SamplerOutput(token_ids, chosen, None, None)
    top = logp.topk(min(k, logp.size(1)), dim=-1)
    return SamplerOutput(token_ids, chosen, top.indices, top.values)
