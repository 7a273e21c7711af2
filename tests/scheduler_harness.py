"""A fake engine that drives the Scheduler as the real one does, checking invariants each step.

It writes each computed token into a fake paged KV cache through the block table
and, whenever a sequence samples, checks that every earlier token of it is still in its blocks,
so a block handed to two sequences or a wrong table shows up as a wrong token.
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

    def __init__(self, num_blocks: int, **config):
        self.config = EngineConfig(device="cpu", **config)
        self.bm = BlockManager(num_blocks, self.config.block_size)
        self.sched = Scheduler(self.config, self.bm)
        self.kv: dict[tuple[int, int], tuple[int, int, int]] = {}  # (block, slot) -> written
        self.order: dict[int, int] = {}  # seq_id -> arrival rank
        self.seqs: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []
        self.errored: list[Sequence] = []
        self.joined_while_running = False

    def add(self, prompt_len: int, max_new: int) -> Sequence:
        prompt = [random.randrange(50_000) for _ in range(prompt_len)]
        seq = Sequence(prompt, SamplingParams(max_new_tokens=max_new))
        self.order[seq.seq_id] = len(self.order)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        running_before = self.sched.running
        out = self.sched.schedule()
        self._check_output(out, running_before)
        self._check_pool()
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
        return out

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
            self.kv[(seq.block_table[pos // bs], pos % bs)] = (seq.seq_id, pos, ids[pos])

    def _check_kv(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        for pos, tok in enumerate(seq.token_ids):
            got = self.kv.get((seq.block_table[pos // bs], pos % bs))
            assert got == (seq.seq_id, pos, tok), f"{seq}: KV at position {pos} is {got}"

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

    def _check_pool(self) -> None:
        """Blocks: running sequences own disjoint tables covering their tokens, the rest free."""
        held = [b for s in self.sched.running for b in s.block_table]
        assert len(held) == len(set(held)) == self.bm.num_blocks - self.bm.num_free_blocks
        assert all(s.block_table == [] for s in self.sched.waiting)
        ranks = [self.order[s.seq_id] for s in self.sched.running + self.sched.waiting]
        assert ranks == sorted(ranks), "running then waiting must stay in arrival order"
        partial = [s for s in self.sched.running if s.num_scheduled_tokens > 1
                   and not s.samples_this_step]  # fmt: skip
        assert partial in ([], list(self.sched.running[-1:])), "only the newest may be part-way"
        for seq in self.sched.running:
            need = self.bm.num_blocks_for(seq.num_computed_tokens + seq.num_scheduled_tokens)
            assert len(seq.block_table) >= need
