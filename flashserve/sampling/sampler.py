"""Token sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded noise.

A sampled row picks ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry (the exponential
race, i.e. Gumbel-max): that is an exact draw from ``p``. ``E`` comes from a counter-based hash
of (row seed, row step, vocab index) made of integer tensor ops, so a row's token depends only on
its own logits, seed and step: not on the other rows, the batch order or any generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashserve.engine.sequence import Sequence
from flashserve.engine.staging import Staging, Upload
from flashserve.sampling.inputs import TokenArrays, stage_penalties, stage_sampling
from flashserve.sampling.noise import hash32_, noise_fn


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
        # [S, 1]: >= 1 for any top_p > 0; the clamp keeps a row whose top_p is 0 (or whose
        # probabilities are NaN) on its best token instead of gathering at index -1, which on
        # CUDA is a device-side assert that poisons the whole context
        kept = (before < b.top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
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

    def __init__(self, vocab_size: int, device: torch.device | str, compile: bool = True):
        """compile: fuse the noise with torch.compile on CUDA (a few seconds here, once)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=self.device)
        self._vocab_hash = hash32_(vocab)  # [V]
        self._noise = noise_fn(self.device, self._vocab_hash, compile)
        self._tokens = TokenArrays(vocab_size)
        self._staging: Staging | None = None  # prepare()'s own, when no upload is given

    @staticmethod
    def plain_greedy(seqs: list[Sequence]) -> bool:
        """Every row greedy, without penalties or top logprobs: its token is the argmax of the
        raw logits and its logprob the log-softmax there, which a CUDA graph computes itself."""
        return all(s.params.greedy for s in seqs) and Sampler.overlappable(seqs)

    @staticmethod
    def overlappable(seqs: list[Sequence]) -> bool:
        """No row needs a token the host has not read yet (penalties) or top logprobs: a step
        can then be queued before the host reads the one before it."""
        return all(
            not s.params.logprobs
            and s.params.repetition_penalty == 1.0
            and s.params.presence_penalty == 0.0
            and s.params.frequency_penalty == 0.0
            for s in seqs
        )

    def prepare(self, seqs: list[Sequence], ahead: bool = False,
                upload: Upload | None = None) -> SamplingBatch:  # fmt: skip
        """Host -> device: per-row parameters and, if used, penalty histories, added to
        ``upload`` (the step's one copy; the batch is usable once it is sent) or, without one,
        sent in a copy of their own (valid until the next ``prepare`` is sent, as any upload's
        tensors). ``ahead``: each row's last token is still on the device (a step queued
        ahead), so the token sampled is one further than ``num_tokens`` says."""
        up = upload if upload is not None else self._own_upload()
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        floats = ints = rows = None
        if sampled:
            floats, ints, rows = stage_sampling(up, seqs, sampled, int(ahead))
        penalties = stage_penalties(up, seqs, self._tokens)
        if upload is None:
            up.send()
        ps = [seqs[i].params for i in sampled]
        return SamplingBatch(
            num_seqs=len(seqs),
            num_sampled=len(sampled),
            sample_rows=rows,
            temperature=None if floats is None else floats[0],
            top_p=None if floats is None else floats[1],
            min_p=None if floats is None else floats[2],
            top_k=None if ints is None else ints[0],
            seed=None if ints is None else ints[1],
            step=None if ints is None else ints[2],
            max_top_k=max((p.top_k for p in ps if 0 < p.top_k < self.vocab_size), default=0),
            use_top_p=any(p.top_p < 1.0 for p in ps),
            use_min_p=any(p.min_p > 0.0 for p in ps),
            penalties=None if penalties is None else Penalties(*penalties[0], *penalties[1:]),
            max_logprobs=max((s.params.logprobs or 0 for s in seqs), default=0),
        )

    def _own_upload(self) -> Upload:
        if self._staging is None:
            self._staging = Staging(self.device)
        return self._staging.begin()

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
        return probs.div_(self._noise(b.seed, b.step, self._vocab_hash)).argmax(dim=-1)


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    """Raw logits [N, V] and chosen ids [N] -> output with log-softmax values of the raw logits."""
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if not k:
        return SamplerOutput(token_ids, chosen, None, None)
    top = logp.topk(min(k, logp.size(1)), dim=-1)
    return SamplerOutput(token_ids, chosen, top.indices, top.values)
