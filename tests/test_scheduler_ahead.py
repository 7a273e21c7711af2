"""The scheduler's look-ahead step (async scheduling): ``schedule_ahead`` plans the decode step
queued before the host reads the one before it, ``update`` counts it once its tokens are read.

``AsyncFakeEngine`` (tests/scheduler_harness.py) drives it as the engine does and checks every
look-ahead step (the rows that go on, their blocks) and the tokens in the fake paged KV cache.
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import AsyncFakeEngine

from flashserve.engine.block_manager import peak_blocks
from flashserve.engine.scheduler import SchedulerOutput


def _arrivals(num_seqs: int, max_prompt: int, max_new: int, spread: int):
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for _ in range(num_seqs):
        lengths = (random.randint(1, max_prompt), random.randint(1, max_new))
        arrivals.setdefault(random.randrange(spread), []).append(lengths)
    return arrivals


def _blocks(arrivals, block_size: int) -> list[int]:
    return [-(-(p + m) // block_size) for seqs in arrivals.values() for p, m in seqs]


@pytest.mark.parametrize("trial", range(4))
def test_look_ahead_random_workload(trial: int) -> None:
    """Arrivals end the overlap, stops and aborts drop rows, the context length caps it:
    every sequence still gets its tokens, every block comes back, and a decode step is queued
    ahead whenever it can be (the harness checks each refusal)."""
    bs = random.choice([1, 4, 16])
    arrivals = _arrivals(random.randint(10, 30), 60, 60, spread=100)
    eng = AsyncFakeEngine(
        sum(_blocks(arrivals, bs)),
        stop_prob=0.03,
        abort_prob=0.003,
        block_size=bs,
        max_num_seqs=random.choice([2, 4, 8, 32]),
        max_num_batched_tokens=random.choice([16, 64, 256]),
        max_model_len=random.choice([None, 100]),
    )
    eng.run(arrivals)
    eng.check_all_done()
    assert eng.aheads


@pytest.mark.parametrize("trial", range(4))
def test_look_ahead_with_a_short_pool(trial: int) -> None:
    """A pool that barely holds the longest sequence: the look-ahead stops when a row needs a
    block that is not free, the next plan preempts, and everyone still finishes.

    Some draws never queue a look-ahead (pages of one token in a pool the size of the longest
    sequence preempt so often that every step has a prefill in it): every draw is checked, and
    draws go on until one has exercised both the look-ahead and a preemption."""
    for _ in range(20):
        bs = random.choice([1, 4, 16])
        arrivals = _arrivals(random.randint(20, 40), 80, 60, spread=10)
        eng = AsyncFakeEngine(
            max(_blocks(arrivals, bs)) + random.randint(0, 3),
            stop_prob=0.01,
            block_size=bs,
            max_num_seqs=random.choice([4, 8, 32]),
            max_num_batched_tokens=random.choice([16, 64, 256]),
        )
        eng.run(arrivals)
        eng.check_all_done()
        if eng.aheads and any(out.preempted for out in eng.outputs):
            return
    pytest.fail("no draw queued a look-ahead step and preempted")


@pytest.mark.parametrize("trial", range(4))
def test_look_ahead_with_a_window(trial: int) -> None:
    """Every layer windowed, a pool a little larger than one sequence's peak: blocks go back
    as each step's tokens are read (look-ahead steps too) while the step queued after reads
    only later positions; every read finds its token, everyone finishes, nothing leaks.

    About 3% of draws queue no look-ahead at all (every step has a prefill in it): every draw
    is checked, and draws go on until one has queued look-aheads with a sequence that outgrew
    the pool."""
    for _ in range(20):
        bs = random.choice([1, 4, 16])
        window = random.choice([1, 7, 16, 40])
        budget = random.choice([4, 16, 64])
        arrivals = _arrivals(random.randint(5, 15), 200, 200, spread=40)
        eng = AsyncFakeEngine(
            peak_blocks(10**6, bs, window, budget) + random.randint(1, 4),
            window=window,
            stop_prob=0.01,
            abort_prob=0.002,
            block_size=bs,
            max_num_seqs=random.choice([2, 4, 32]),
            max_num_batched_tokens=budget,
        )
        longest = max(_blocks(arrivals, bs))
        eng.run(arrivals)
        eng.check_all_done()
        assert not eng.errored, eng.errored
        if eng.aheads and longest > eng.bm.num_blocks:
            return
    pytest.fail("no draw queued a look-ahead step with a sequence longer than the pool")


def test_rows_that_their_next_token_ends_are_not_queued() -> None:
    """A sequence one token from max_new_tokens or from the context length gets no row; the
    others get theirs, in the order of the step before, with a block for the new position."""
    eng = AsyncFakeEngine(100, block_size=4, max_num_batched_tokens=64, max_model_len=40)
    last_new = eng.add(5, 2)  # the token of the step queued is its last
    at_context = eng.add(38, 50)  # that token is the context's 40th
    grows = eng.add(7, 50)  # the look-ahead computes position 8: a third block
    eng.step()  # the prompts, plainly
    prev = eng.step()  # the first decodes, queued
    assert eng.in_flight is prev and prev.ahead_rows is None
    blocks = len(grows.block_table)
    nxt = eng.sched.schedule_ahead(prev)
    assert nxt is not None and nxt.seqs == [grows] and nxt.ahead_rows == [2]
    assert nxt.num_decodes == 1 and len(grows.block_table) == blocks + 1 == 3
    assert (last_new.num_computed_tokens, grows.num_computed_tokens) == (5, 7)  # not counted
    eng.sched.update(prev)  # prev's tokens read: counted, then appended
    for seq in prev.seqs:
        seq.append_token(0)
    eng.sched.update(nxt)
    assert grows.num_computed_tokens == grows.num_tokens == 9
    assert at_context.num_computed_tokens == 39


def test_no_look_ahead_when_the_pool_is_short_a_row_is_missing_or_requests_wait() -> None:
    eng = AsyncFakeEngine(2, block_size=4, max_num_batched_tokens=64)
    a, b = eng.add(3, 10), eng.add(3, 10)
    eng.step()
    prev = eng.step()  # both decode, queued: each holds one full block, none is free
    assert eng.in_flight is prev and eng.bm.num_free_blocks == 0
    tables = [list(a.block_table), list(b.block_table)]
    assert eng.sched.schedule_ahead(prev) is None  # position 4 needs a block each
    assert eng.sched.schedule_ahead(SchedulerOutput(seqs=[a])) is None  # b runs outside it
    assert [a.block_table, b.block_table] == tables and a.num_scheduled_tokens == 1
    eng = AsyncFakeEngine(10, block_size=4, max_num_batched_tokens=64)
    eng.add(3, 10)
    eng.step()
    prev = eng.step()
    waiting = eng.add(1, 1)
    assert eng.sched.schedule_ahead(prev) is None  # it joins the next planned step
    eng.sched.abort(waiting.seq_id)
    assert eng.sched.schedule_ahead(prev) is not None


def test_unschedule_forgets_the_steps_in_flight() -> None:
    """After a failure the engine drops the steps in flight: the next plan computes the same
    tokens again (their blocks stay)."""
    eng = AsyncFakeEngine(100, block_size=4, max_num_batched_tokens=64)
    seqs = [eng.add(random.randint(1, 20), 10) for _ in range(3)]
    eng.step()
    eng.step()
    prev = eng.in_flight
    assert eng.sched.schedule_ahead(prev) is not None
    eng.sched.unschedule()
    out = eng.sched.schedule()
    assert out.seqs == seqs and out.num_decodes == 3 and not out.preempted
    assert all(s.num_scheduled_tokens == 1 == s.num_uncomputed_tokens for s in seqs)
