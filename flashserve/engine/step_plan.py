"""A step's inputs on the host, built once, whichever way the step then runs.

``StepPlan.build`` is the one builder, for both kinds of step:

- a step the scheduler planned: each sequence computes ``num_scheduled_tokens`` tokens from
  position ``num_computed_tokens``; decodes (one token each) first, then prefill chunks;
- a look-ahead step (``rows``), queued while the step before it still runs: each sequence
  computes the token that step picks for it in row ``rows[i]``, at position ``num_tokens`` (the
  host has not appended it yet). Its input ids are those rows; the runner gathers the tokens
  on the device.

The model runner stages a plan in one upload (``flashserve.engine.staging``) and runs it eagerly
or by graph replay. Work per sequence is O(tokens computed + blocks), not O(context).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flashserve.engine.sequence import Sequence


@dataclass
class StepPlan:
    """Flattened host inputs of one step over ``B`` sequences and ``T`` tokens."""

    input_ids: list[int]  # [T]; a look-ahead step: rows of the previous step's picks
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] cache slot of each token
    seq_lens: list[int]  # [B] KV length after this step
    q_lens: list[int]  # [B] tokens computed this step
    block_tables: list[list[int]]  # [B] the sequences' own tables (read, never copied)
    num_decodes: int  # the first num_decodes sequences compute one token each
    sample_rows: list[int]  # [N] token rows whose logits are sampled
    sampling: list[Sequence]  # [N] the sequence of each sampled row
    ahead: bool  # a look-ahead step: each row samples the token after the one on the device
    eager: bool = False  # never by graph replay, on any rank (``ModelRunner.every_logits``)

    @classmethod
    def build(cls, seqs: list[Sequence], block_size: int,
              rows: list[int] | None = None) -> StepPlan:  # fmt: skip
        """The plan of a scheduled step over ``seqs`` (decodes first), or, with ``rows``, of
        the look-ahead step whose row i takes its token from row ``rows[i]`` of the step before
        (every block table must already hold position ``num_tokens``)."""
        ids, positions, slots, seq_lens, q_lens, sample_rows, sampling = [], [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            if rows is None:
                start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
                ids.extend(_token_slice(seq, start, n))
                samples = seq.samples_this_step
            else:
                start, n, samples = seq.num_tokens, 1, True
                ids.append(rows[i])
            table = seq.block_table
            positions.extend(range(start, start + n))
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, start + n))  # fmt: skip
            seq_lens.append(start + n)
            q_lens.append(n)
            if samples:
                sample_rows.append(len(ids) - 1)
                sampling.append(seq)
        return cls(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            seq_lens=seq_lens,
            q_lens=q_lens,
            block_tables=[s.block_table for s in seqs],
            num_decodes=_count_leading_ones(q_lens),
            sample_rows=sample_rows,
            sampling=sampling,
            ahead=rows is not None,
        )

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @cached_property
    def table_width(self) -> int:
        """Columns of the padded block tables: the longest table (at least 1)."""
        return max(1, max(map(len, self.block_tables), default=0))

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and samples the next (what a graph captures)."""
        b = self.batch_size
        return b > 0 and self.num_decodes == b and len(self.sample_rows) == b

    @property
    def samples_every_token(self) -> bool:
        """Every token row is sampled: the hidden states need no gather before the logits."""
        return len(self.sample_rows) == len(self.input_ids)


def _token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """``seq.token_ids[start:start+n]`` without concatenating prompt and output."""
    p = seq.num_prompt_tokens
    if start >= p:
        return seq.output_token_ids[start - p : start - p + n]
    if start + n <= p:
        return seq.prompt_token_ids[start : start + n]
    return seq.token_ids[start : start + n]


def _count_leading_ones(q_lens: list[int]) -> int:
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n
