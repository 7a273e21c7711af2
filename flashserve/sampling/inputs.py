"""Host side of the sampler: one step's per-row inputs, added to the step's one upload."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from flashserve.engine.sequence import Sequence
from flashserve.engine.staging import Upload


def stage_sampling(
    upload: Upload, seqs: list[Sequence], rows: list[int], ahead: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sampled ``rows`` of ``seqs``: floats [3, S] float32 (temperature, top_p, min_p),
    ints [3, S] int64 (top_k, seed, position of the token sampled) and the row indices [S]
    (None when every row samples), added to ``upload``. ``ahead``: tokens the host has not
    appended yet (a step queued ahead samples one further)."""
    ps = [seqs[i].params for i in rows]
    if any(p.seed is None for p in ps):
        raise ValueError("every sampled sequence needs params.seed (the engine sets it)")
    floats = np.array([[p.temperature for p in ps], [p.top_p for p in ps],
                       [p.min_p for p in ps]], dtype=np.float32)  # fmt: skip
    steps = [seqs[i].num_tokens + ahead for i in rows]
    ints = np.array([[p.top_k for p in ps], [p.seed for p in ps], steps], dtype=np.int64)
    index = upload.add(rows, torch.int64) if len(rows) < len(seqs) else None
    return upload.add(floats, torch.float32), upload.add(ints, torch.int64), index


def stage_penalties(
    upload: Upload, seqs: list[Sequence], tokens: TokenArrays
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """Penalty inputs when some row uses one (else None), added to ``upload``: floats [3, N]
    float32 (repetition, presence, frequency), then the flat ``row * V + token`` indices of
    the prompt + output tokens of rows with a repetition penalty, and of the output tokens of
    rows with a presence or frequency penalty (None when no row needs them)."""
    ps = [s.params for s in seqs]
    rep = [r for r, p in enumerate(ps) if p.repetition_penalty != 1.0]
    out = [r for r, p in enumerate(ps) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep and not out:
        return None
    cols = [
        [p.repetition_penalty for p in ps],
        [p.presence_penalty for p in ps],
        [p.frequency_penalty for p in ps],
    ]
    floats = upload.add(np.array(cols, dtype=np.float32), torch.float32)
    arrays = {r: tokens(seqs[r]) for r in sorted(set(rep) | set(out))}
    v = tokens.vocab_size
    seen = upload.add(_flat([arrays[r] for r in rep], rep, v), torch.int64) if rep else None
    output = None
    if out:
        outputs = [arrays[r][seqs[r].num_prompt_tokens :] for r in out]
        output = upload.add(_flat(outputs, out, v), torch.int64)
    return floats, seen, output


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
