"""A fake engine that drives the Scheduler as the real one does, checking invariants each step.

It writes each computed token into a fake paged KV cache through the block table and checks
that every token a step reads is still in its blocks (all earlier tokens; with a sliding
``window``, those of the window), so a block handed to two sequences, a wrong table or a block
released while still in the window shows up as a wrong token. With a window it also checks that
each sequence holds exactly the blocks from its window's first one on, no more than
``peak_blocks``.

Prefix caching (on unless ``enable_prefix_caching=False``): prompts may start with one of
``prefixes``. A slot records which sequence wrote it; a token read from a block another
sequence wrote must be that sequence's token at that position after the same prefix. Every
step it checks that a reference count equals the number of running sequences that hold the
block, that no step writes into a keyed (cached) block, that each keyed block holds what its
writer computed for the tokens its key names, and the block manager's own records
(``BlockManager.check``).
"""

from __future__ import annotations

import random

from flashserve.config import EngineConfig
from flashserve.engine.block_manager import BlockManager
from flashserve.engine.scheduler import Scheduler, SchedulerOutput
from flashserve.engine.sequence import Sequence, SequenceStatus
from flashserve.sampling.params import SamplingParams


def token(seq_id: int, pos: int) -> int:
    """The fake model's output at position ``pos``: a function of the position only."""
    return (seq_id * 7919 + pos * 31) % 50_000


class FakeEngine:
    """Drives a Scheduler as the engine does, checking its invariants at every step."""

    ahead = 0  # steps queued ahead of the host (blocks grown for them)

    def __init__(self, num_blocks: int, window: int = 0, **config):
        self.config = EngineConfig(device="cpu", **config)
        self.bm = BlockManager(num_blocks, self.config.block_size, window,
                               prefix_caching=self.config.enable_prefix_caching)  # fmt: skip
        self.window = window
        self.sched = Scheduler(self.config, self.bm)
        self.kv: dict[tuple[int, int], tuple[int, int, int]] = {}  # (block, slot) -> written
        self.by_id: dict[int, Sequence] = {}  # seq_id -> sequence (the writers of self.kv)
        self.prefixes: list[list[int]] = []  # prompts start with one of these half the time
        self.verified: dict[int, bytes] = {}  # block -> the key its contents were checked for
        self.order: dict[int, int] = {}  # seq_id -> arrival rank
        self.seqs: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []
        self.errored: list[Sequence] = []
        self.joined_while_running = False

    def add(self, prompt_len: int, max_new: int) -> Sequence:
        prompt = [random.randrange(50_000) for _ in range(prompt_len)]
        if self.prefixes and random.random() < 0.5:
            prefix = random.choice(self.prefixes)
            k = random.randint(0, min(len(prefix), prompt_len))
            prompt[:k] = prefix[:k]
        seq = Sequence(prompt, SamplingParams(max_new_tokens=max_new))
        self.by_id[seq.seq_id] = seq
        self.order[seq.seq_id] = len(self.order)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self._schedule()
        self._run(out)
        return out

    def _schedule(self) -> SchedulerOutput:
        running_before = self.sched.running
        out = self.sched.schedule()
        self._check_output(out, running_before)
        self._check_pool()
        return out

    def _run(self, out: SchedulerOutput) -> None:
        """Compute ``out`` and read its tokens at once."""
        sampled = [s for s in out.seqs if s.samples_this_step]
        for seq in out.seqs:
            self._write_kv(seq)
        done = [s for s in sampled if s.num_output_tokens + 1 == s.params.max_new_tokens]
        if random.random() < 0.5:  # the real engine's order: update, append, finish
            self.sched.update(out)
            self._sample(sampled)
            for seq in done:
                self.sched.finish(seq, "length")
        else:  # finishing before update() must work as well
            self._sample(sampled)
            for seq in done:
                self.sched.finish(seq, "length")
            self.sched.update(out)
        self.outputs.append(out)

    def run(self, arrivals: dict[int, list[tuple[int, int]]], max_steps: int = 100_000) -> int:
        """Add ``arrivals[step]`` (prompt length, max new tokens) at each step; run to the end."""
        step = 0
        while arrivals or self.sched.has_unfinished:
            for prompt_len, max_new in arrivals.pop(step, []):
                self.add(prompt_len, max_new)
            self.step()
            step += 1
            assert step < max_steps, "the scheduler made no progress"
        return step

    def check_all_done(self) -> None:
        for seq in self.seqs:
            if seq in self.errored:
                assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "error"
                continue
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
            n = seq.params.max_new_tokens
            want = [token(seq.seq_id, seq.num_prompt_tokens + i) for i in range(n)]
            assert seq.output_token_ids == want, f"{seq}: wrong tokens"
            assert seq.block_table == []
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))
        assert not self.sched.has_unfinished and self.sched.num_running == 0

    def _sample(self, sampled: list[Sequence]) -> None:
        for seq in sampled:
            self._check_kv(seq)
            seq.append_token(token(seq.seq_id, seq.num_tokens))

    def _write_kv(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        start = seq.num_computed_tokens
        ids = seq.token_ids
        for pos in range(start, start + seq.num_scheduled_tokens):
            block = seq.block_table[pos // bs]
            assert self.bm.key_of(block) is None, f"{seq} writes into cached block {block}"
            self.kv[(block, pos % bs)] = (seq.seq_id, pos, ids[pos])
        self._check_kv(seq, start, start + seq.num_scheduled_tokens)

    def _first_read(self, pos: int) -> int:
        """The first position a token at ``pos`` reads."""
        return max(0, pos - self.window + 1) if self.window else 0

    def _check_kv(self, seq: Sequence, start: int | None = None, end: int | None = None) -> None:
        """The tokens that computing positions ``start .. end - 1`` reads (default: the last
        token) are in ``seq``'s blocks."""
        end = seq.num_tokens if end is None else end
        start = end - 1 if start is None else start
        bs = self.bm.block_size
        ids = seq.token_ids
        for pos in range(self._first_read(start), end):
            got = self.kv.get((seq.block_table[pos // bs], pos % bs))
            assert self._same(got, seq.seq_id, pos, ids), f"{seq}: KV at position {pos} is {got}"

    def _same(self, got: tuple[int, int, int] | None, seq_id: int, pos: int, ids: list[int]
              ) -> bool:  # fmt: skip
        """Whether the slot record ``got`` is the KV of token ``ids[pos]`` after ``ids[:pos]``
        (written by ``seq_id`` itself, or by a sequence with the same tokens up to ``pos``)."""
        if got is None or got[1] != pos or got[2] != ids[pos]:
            return False
        return got[0] == seq_id or self.by_id[got[0]].token_ids[: pos + 1] == ids[: pos + 1]

    def _check_held(self, seq: Sequence) -> None:
        """``seq`` owns its table's blocks from the first one its next token reads on (all of
        them without a window), and with a window no more than a window and a step need
        (``ahead`` more tokens' worth while a look-ahead step may hold a block more)."""
        bs = self.bm.block_size
        first = min(self._first_read(seq.num_computed_tokens) // bs, len(seq.block_table))
        assert seq.num_released_blocks == first, f"{seq}: {seq.num_released_blocks} released"
        if self.window:
            n, c = seq.num_tokens + self.ahead, self.config.max_num_batched_tokens
            peak = self.bm.peak_blocks(n, c) + self.ahead
            assert len(seq.held_blocks) <= peak, f"{seq} holds more than {peak} blocks"

    def _check_output(self, out: SchedulerOutput, running_before: tuple[Sequence, ...]) -> None:
        cfg = self.config
        counts = [s.num_scheduled_tokens for s in out.seqs]
        assert out.num_batched_tokens == sum(counts) <= cfg.max_num_batched_tokens
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs) <= cfg.max_num_seqs
        assert self.sched.num_running <= cfg.max_num_seqs
        is_decode = [n == 1 for n in counts]
        assert is_decode == sorted(is_decode, reverse=True), f"decodes not first: {counts}"
        assert out.num_decodes == sum(is_decode) and out.is_empty == (not out.seqs)
        for seq in out.seqs:
            assert 1 <= seq.num_scheduled_tokens <= seq.num_uncomputed_tokens
            assert seq.status is SequenceStatus.RUNNING
        if any(s.num_computed_tokens for s in out.seqs) and any(
            s.num_computed_tokens == 0 and not s.num_preemptions for s in out.seqs
        ):
            self.joined_while_running = True
        self._check_preempted(out, running_before)
        self.errored += out.errored

    def _check_preempted(self, out: SchedulerOutput, running_before) -> None:
        rank = [self.order[s.seq_id] for s in out.preempted]
        assert rank == sorted(rank, reverse=True), "victims must go newest first"
        for seq in out.preempted:
            assert seq in running_before and seq.status is SequenceStatus.WAITING
            assert seq.num_computed_tokens == 0 and seq.block_table == []
            assert all(self.order[r.seq_id] < self.order[seq.seq_id] for r in self.sched.running)
        assert list(self.sched.waiting[: len(rank)]) == out.preempted[::-1]

    def _check_holders(self) -> None:
        """Each block's reference count is the number of running sequences holding it (no
        sequence holds one twice); the blocks nobody holds are the free ones; keyed blocks
        hold what their writer computed for the tokens their key names."""
        bm = self.bm
        bm.check()
        holders = [0] * bm.num_blocks
        for seq in self.sched.running:
            assert len(set(seq.held_blocks)) == len(seq.held_blocks), f"{seq} holds one twice"
            for b in seq.held_blocks:
                holders[b] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
        assert bm.num_free_blocks == holders.count(0)
        bs = bm.block_size
        for b in range(bm.num_blocks):
            key = bm.key_of(b)
            if key is None or self.verified.get(b) == key:  # no step writes a keyed block
                continue
            self.verified[b] = key
            slots = [self.kv.get((b, i)) for i in range(bs)]
            assert None not in slots and len({w for w, _, _ in slots}) == 1, f"block {b}"
            writer, first = self.by_id[slots[0][0]], slots[0][1]
            assert first % bs == 0 and [p for _, p, _ in slots] == list(range(first, first + bs))
            assert all(self._same(g, writer.seq_id, g[1], writer.token_ids) for g in slots)
            index = first // bs
            assert bm.keys(writer, index + 1)[index] == key, f"block {b}: a wrong key"

    def _check_pool(self) -> None:
        """Blocks: held blocks counted right (shared only through the prefix cache), tables
        covering their tokens, the rest free."""
        self._check_holders()
        if not self.bm.prefix_caching:
            held = [b for s in self.sched.running for b in s.held_blocks]
            assert len(held) == len(set(held)), "a block held twice without prefix caching"
        assert all(s.block_table == [] for s in self.sched.waiting)
        ranks = [self.order[s.seq_id] for s in self.sched.running + self.sched.waiting]
        assert ranks == sorted(ranks), "running then waiting must stay in arrival order"
        partial = [s for s in self.sched.running if s.num_scheduled_tokens > 1
                   and not s.samples_this_step]  # fmt: skip
        assert partial in ([], list(self.sched.running[-1:])), "only the newest may be part-way"
        for seq in self.sched.running:
            need = self.bm.num_blocks_for(seq.num_computed_tokens + seq.num_scheduled_tokens)
            assert len(seq.block_table) >= need
            self._check_held(seq)


class AsyncFakeEngine(FakeEngine):
    """Drives the scheduler as the engine does with async scheduling: a step whose rows all
    decode and sample is queued, and while it runs the look-ahead step after it is planned
    (``schedule_ahead``) and queued before its tokens are read. The fake device computes a
    step (writes its KV) when it is queued, in queue order, as the real one does on its stream.
    A token stops its sequence with probability ``stop_prob`` (as EOS or a stop string would);
    each step a running sequence is aborted with probability ``abort_prob``."""

    ahead = 1

    def __init__(self, num_blocks: int, stop_prob: float = 0.0, abort_prob: float = 0.0,
                 **config):  # fmt: skip
        super().__init__(num_blocks, **config)
        self.stop_prob, self.abort_prob = stop_prob, abort_prob
        self.in_flight: SchedulerOutput | None = None
        self.aheads: list[SchedulerOutput] = []
        self.writes: dict[tuple[int, int], int] = {}  # (seq_id, position) -> KV writes

    def step(self) -> SchedulerOutput:
        prev = self.in_flight
        if prev is None:
            out = self._schedule()
            if not (out.seqs and all(s.num_scheduled_tokens == 1 and s.samples_this_step
                                     for s in out.seqs)):  # fmt: skip
                self._run(out)
                return out
            for seq in out.seqs:
                self._write_kv(seq)
            self.outputs.append(out)
            self.in_flight = out
            return out
        nxt = self.sched.schedule_ahead(prev)
        if nxt is None:
            self._check_no_ahead(prev)
        else:
            self._check_ahead(prev, nxt)
            for seq in nxt.seqs:
                pos = seq.num_tokens  # prev's token, not appended yet: its value is known here
                self._write_slot(seq, pos, token(seq.seq_id, pos))
                self._check_ahead_reads(seq, pos)
            self.aheads.append(nxt)
        self._collect(prev)
        self.in_flight = nxt
        self._maybe_abort()
        return nxt or prev

    def _run(self, out: SchedulerOutput) -> None:
        """A step run plainly: computed and read at once."""
        for seq in out.seqs:
            self._write_kv(seq)
        sampled = [s for s in out.seqs if s.samples_this_step]
        self.sched.update(out)
        for seq in sampled:
            self._append(seq)
        self.outputs.append(out)

    def _collect(self, out: SchedulerOutput) -> None:
        """Read a queued step's tokens: count it, append them."""
        self.sched.update(out)
        for seq in out.seqs:
            if seq.status is SequenceStatus.RUNNING:  # else stopped or aborted while it ran
                self._append(seq)

    def _append(self, seq: Sequence) -> None:
        """Append the token sampled, as the engine does: finish at a limit, or on a stop."""
        self._check_kv(seq)
        seq.append_token(token(seq.seq_id, seq.num_tokens))
        limit = self.sched.max_model_len
        if seq.num_output_tokens == seq.params.max_new_tokens or seq.num_tokens >= limit:
            self.sched.finish(seq, "length")
        elif random.random() < self.stop_prob:
            self.sched.finish(seq, "stop")

    def _maybe_abort(self) -> None:
        for seq in self.sched.running:
            if random.random() < self.abort_prob:
                self.sched.abort(seq.seq_id)

    def _ends(self, seq: Sequence) -> bool:
        """Whether the token not appended yet ends ``seq`` at a length limit."""
        limit = self.sched.max_model_len
        return seq.num_output_tokens + 1 >= seq.params.max_new_tokens or seq.num_tokens + 1 >= limit

    def _check_no_ahead(self, prev: SchedulerOutput) -> None:
        """A look-ahead refused: a request waits, a running sequence is not in prev, no row
        goes on, or the pool lacks the blocks the rows need."""
        running = set(self.sched.running)
        if self.sched.num_waiting or not running <= set(prev.seqs):
            return
        go = [s for s in prev.seqs if s in running and not self._ends(s)]
        need = sum(self.bm.blocks_to_hold(s, s.num_tokens + 1) for s in go)
        assert not go or need > self.bm.num_free_blocks, "a look-ahead step it could plan"

    def _check_ahead(self, prev: SchedulerOutput, nxt: SchedulerOutput) -> None:
        """The look-ahead step: prev's rows that go on, in prev's order, each with a block for
        the position it computes; every other running sequence's next token ends it."""
        assert nxt.ahead_rows is not None and nxt.num_decodes == len(nxt.seqs) > 0
        assert [prev.seqs[i] for i in nxt.ahead_rows] == nxt.seqs
        assert nxt.ahead_rows == sorted(set(nxt.ahead_rows))
        assert not self.sched.num_waiting
        assert set(self.sched.running) <= set(prev.seqs)
        for seq in self.sched.running:
            assert (seq in nxt.seqs) == (not self._ends(seq)), seq
        for seq in nxt.seqs:
            assert len(seq.block_table) >= self.bm.num_blocks_for(seq.num_tokens + 1)
        for seq in self.sched.running:
            self._check_held(seq)
        self._check_holders()

    def _write_kv(self, seq: Sequence) -> None:
        ids, start = seq.token_ids, seq.num_computed_tokens
        for pos in range(start, start + seq.num_scheduled_tokens):
            self._write_slot(seq, pos, ids[pos])
        self._check_kv(seq, start, start + seq.num_scheduled_tokens)

    def _check_ahead_reads(self, seq: Sequence, pos: int) -> None:
        """What the look-ahead step computing ``pos`` (its token not appended) reads."""
        bs = self.bm.block_size
        ids = seq.token_ids + [token(seq.seq_id, pos)]
        for p in range(self._first_read(pos), pos + 1):
            got = self.kv.get((seq.block_table[p // bs], p % bs))
            assert self._same(got, seq.seq_id, p, ids), f"{seq}: KV at position {p} is {got}"

    def _write_slot(self, seq: Sequence, pos: int, tok: int) -> None:
        bs = self.bm.block_size
        block = seq.block_table[pos // bs]
        assert self.bm.key_of(block) is None, f"{seq} writes into cached block {block}"
        self.kv[(block, pos % bs)] = (seq.seq_id, pos, tok)
        self.writes[(seq.seq_id, pos)] = self.writes.get((seq.seq_id, pos), 0) + 1

    def check_all_done(self) -> None:
        """Every sequence finished with its right tokens, up to its limit unless it stopped or
        was aborted; no block leaked."""
        for seq in self.seqs:
            assert seq.status is SequenceStatus.FINISHED and seq.block_table == [], seq
            n = seq.num_output_tokens
            want = [token(seq.seq_id, seq.num_prompt_tokens + i) for i in range(n)]
            assert seq.output_token_ids == want, f"{seq}: wrong tokens"
            if seq.finish_reason == "length":
                limit = self.sched.max_model_len
                assert n == seq.params.max_new_tokens or seq.num_tokens == limit, seq
            if not seq.num_preemptions:  # a look-ahead step is counted: nothing is recomputed
                twice = [
                    p for p in range(seq.num_tokens) if self.writes.get((seq.seq_id, p), 0) > 1
                ]
                assert not twice, f"{seq}: positions {twice[:5]} computed twice"
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert not self.sched.has_unfinished and self.sched.num_running == 0
