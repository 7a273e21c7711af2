"""Continuous batching under a token budget: which sequences compute how many tokens each step.

One rule covers prefill, chunked prefill, decode and recompute: a scheduled sequence computes
``min(num_uncomputed_tokens, budget left)`` tokens. Each step takes running sequences first, in
arrival order, then waiting ones, first come first served, while the budget, ``max_num_seqs``
and the free KV blocks allow (none in a step that had to preempt).

Only the last sequence admitted in a step can get less than all its tokens (the budget is then
spent), so the one running sequence part-way through a prefill is always the newest: the
decodes of older sequences are scheduled before its next chunk and keep flowing. When a running
sequence needs a block and none is free, the newest running sequence is preempted by recompute:
it loses its blocks and goes back to the front of the waiting queue, to recompute prompt plus
outputs later (the same rule again). Older sequences always make progress, so nothing livelocks.

With async scheduling the engine queues a decode step before it reads the tokens of the one
before; ``schedule_ahead`` plans that look-ahead step (which rows go on, their blocks) and
``update`` counts it once its tokens are read, as for any other step.

When every layer of the model is windowed (``BlockManager.window``), ``update`` gives back the
blocks that fell wholly left of each sequence's window, so a sequence holds O(window) blocks
(``peak_blocks``: the window plus one step's tokens) and every count here (admission, growth,
preemption, look-ahead) is of the blocks it holds; a sequence longer than the pool runs.

With prefix caching (``BlockManager.prefix_caching``) a waiting sequence starts on the longest
run of cached blocks at the start of its tokens (``BlockManager.match``), its computed counter
past them, so it computes only the rest through the same rule; admission counts only the blocks
it takes from the free ones. ``update`` keys the blocks a step filled. A preempted sequence
frees its blocks, which stay cached, and its recompute reuses what is still there.
``prefix_cache_queries`` and ``prefix_cache_hits`` count, in tokens, what admissions looked up
and found.

A sequence that needs more blocks at once than the whole pool holds can never run. ``schedule()``
finishes it with reason ``"error"``, sets ``seq.error`` and lists it in
``SchedulerOutput.errored`` rather than raising, so one bad request cannot stop the others.
The scheduler never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flashserve.config import EngineConfig
from flashserve.engine.block_manager import BlockManager
from flashserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work, a plain record for the model runner.

    ``seqs``: the sequences to run, each with ``num_scheduled_tokens`` set: those computing
    exactly one token ("decodes") first, then the rest ("prefills"), each group in schedule
    order. ``preempted``: sequences that lost their blocks in this ``schedule()`` call.
    ``errored``: sequences finished with reason "error" because they can never fit in the KV
    pool (``seq.error`` says why); the engine reports them to their clients.
    ``ahead_rows``: set for a look-ahead step (``Scheduler.schedule_ahead``): ``seqs[i]``
    computes the token that the step before samples in its row ``ahead_rows[i]``, at position
    ``num_tokens``; ``num_scheduled_tokens`` is not used.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    errored: list[Sequence] = field(default_factory=list)
    ahead_rows: list[int] | None = None

    def __post_init__(self) -> None:
        # counted now: update() resets num_scheduled_tokens once the step has run
        if self.ahead_rows is not None:
            self._num_decodes = len(self.seqs)
        else:
            self._num_decodes = sum(1 for s in self.seqs if s.num_scheduled_tokens == 1)

    @property
    def num_decodes(self) -> int:
        """How many of ``seqs`` (the first ones) compute a single token."""
        return self._num_decodes

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class _Step:
    """Work in progress inside one ``schedule()`` call."""

    budget: int
    scheduled: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    errored: list[Sequence] = field(default_factory=list)

    def output(self, max_num_batched_tokens: int) -> SchedulerOutput:
        decodes = [s for s in self.scheduled if s.num_scheduled_tokens == 1]
        prefills = [s for s in self.scheduled if s.num_scheduled_tokens > 1]
        return SchedulerOutput(
            seqs=decodes + prefills,
            num_batched_tokens=max_num_batched_tokens - self.budget,
            preempted=self.preempted,
            errored=self.errored,
        )


class Scheduler:
    """Holds the waiting queue and the running list; plans one step at a time."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 max_model_len: int | None = None):  # fmt: skip
        """``max_model_len``: the context length the engine resolved (default: the config's;
        none at all when both are None): a look-ahead step never computes past it."""
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len or config.max_model_len or 2**62
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # arrival order: the newest is last
        self._live: dict[int, Sequence] = {}  # seq_id -> every unfinished sequence
        self.num_preemptions = 0  # since start, for metrics and tests
        # since start, in tokens: what admissions looked up in the prefix cache, what they found
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- views ---------------------------------------------------------------------------

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    # ---- sequences in and out ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed) at the back."""
        if seq.seq_id in self._live:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"{seq} is not a new waiting sequence")
        self._live[seq.seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish ``seq_id`` with reason "abort" wherever it is; None if it is not here."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` FINISHED with ``reason``, free its blocks and forget it."""
        if self._live.pop(seq.seq_id, None) is not seq:
            raise ValueError(f"{seq} is not in this scheduler: finished twice?")
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step; call ``update()`` with the result once it has run."""
        self._check_updated()
        step = _Step(budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return step.output(self.max_num_batched_tokens)

    def update(self, out: SchedulerOutput) -> None:
        """The step ran (and its tokens were read): its scheduled tokens are now computed; a
        look-ahead step's one token each. Blocks now wholly left of a running sequence's window
        go back to the pool (a step queued after ``out`` computes later positions: it reads
        none of them)."""
        for seq in out.seqs:
            if out.ahead_rows is not None:
                seq.num_computed_tokens += 1
            else:
                seq.num_computed_tokens += seq.num_scheduled_tokens
                seq.num_scheduled_tokens = 0
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.release(seq)

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the decode step after ``prev`` while ``prev`` still runs, its tokens unread:
        every sequence of ``prev`` still running whose next token cannot end it at a length
        limit computes that token (position ``num_tokens``: the host has not appended it).
        Grows their block tables to hold it. None (the overlap ends; plan with ``schedule``
        once ``prev`` is updated) when requests wait, a running sequence is not in ``prev``,
        or the pool lacks a block. ``prev`` must be a decode step (every row sampling) or a
        look-ahead step; ``update(prev)`` comes before ``update`` of the step returned."""
        if self._waiting:
            return None
        seqs = prev.seqs
        if sum(s.status is SequenceStatus.RUNNING for s in seqs) != len(self._running):
            return None
        # prev's token is the one not appended yet: after it a sequence holds num_tokens + 1
        rows = [i for i, s in enumerate(seqs) if s.status is SequenceStatus.RUNNING
                and s.num_output_tokens + 1 < s.params.max_new_tokens
                and s.num_tokens + 1 < self.max_model_len]  # fmt: skip
        nxt = [seqs[i] for i in rows]
        bm = self.block_manager
        need = sum(bm.blocks_to_hold(s, s.num_tokens + 1) for s in nxt)
        if not rows or need > bm.num_free_blocks:
            return None
        for s in nxt:
            bm.grow(s, s.num_tokens + 1)
        return SchedulerOutput(seqs=nxt, num_batched_tokens=len(nxt), ahead_rows=rows)

    def unschedule(self) -> None:
        """Forget the steps planned and not updated (the engine dropped them): each running
        sequence computes the same tokens again at the next ``schedule``. Blocks grown for
        them stay, for that step to use."""
        for seq in self._running:
            seq.num_scheduled_tokens = 0

    def _check_updated(self) -> None:
        for seq in self._running:
            if seq.num_scheduled_tokens:
                raise RuntimeError(f"{seq} is still scheduled: call update() after each step")
            if not seq.num_uncomputed_tokens:
                raise RuntimeError(f"{seq} has nothing to compute: append its sampled token "
                                   "or finish it")  # fmt: skip

    def _schedule_running(self, step: _Step) -> None:
        for seq in list(self._running):
            if step.budget == 0:
                return
            if seq.status is SequenceStatus.RUNNING:  # not preempted or errored in this step
                self._schedule_running_seq(seq, step)

    def _schedule_running_seq(self, seq: Sequence, step: _Step) -> None:
        if self._never_fits(seq, step):
            return
        n = min(seq.num_uncomputed_tokens, step.budget)
        while not self.block_manager.can_allocate(seq, n):
            if self._preempt_newest(step) is seq:
                return
        self._commit(seq, n, step)

    def _schedule_waiting(self, step: _Step) -> None:
        while self._waiting and step.budget and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            if self._never_fits(seq, step):
                continue
            bm = self.block_manager
            hits = bm.match(seq)
            cached = len(hits) * bm.block_size
            n = min(seq.num_tokens - cached, step.budget)
            if bm.blocks_to_admit(hits, n) > bm.num_free_blocks:
                return  # FCFS: nobody overtakes the head of the queue
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            bm.admit(seq, hits, n)
            if bm.prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += cached
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached
            self._commit(seq, n, step)

    def _commit(self, seq: Sequence, n: int, step: _Step) -> None:
        self.block_manager.allocate(seq, n)  # a no-op after admit
        seq.num_scheduled_tokens = n
        step.budget -= n
        step.scheduled.append(seq)

    def _preempt_newest(self, step: _Step) -> Sequence:
        """Preempt by recompute the newest running sequence (not yet scheduled in this step:
        running sequences are scheduled oldest first)."""
        victim = self._running.pop()
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(victim)
        step.preempted.append(victim)
        return victim

    def _never_fits(self, seq: Sequence, step: _Step) -> bool:
        """Finish ``seq`` with an error if its tokens need more blocks at once than the pool
        has (all its tokens' blocks; with a window, those of the window and one step)."""
        bm = self.block_manager
        needed = bm.peak_blocks(seq.num_tokens, self.max_num_batched_tokens)
        if needed <= bm.num_blocks:
            return False
        at_once = f" at once (window {bm.window})" if bm.window else ""
        seq.error = (
            f"sequence {seq.seq_id} has {seq.num_tokens} tokens, which need {needed} KV blocks "
            f"of {bm.block_size} tokens{at_once}; the pool has {bm.num_blocks} blocks in all"
        )
        self.finish(seq, FinishReason.ERROR)
        step.errored.append(seq)
        return True
