"""Scheduler: continuous batching, chunked prefill, preemption, abort, errors.

``FakeEngine`` (tests/scheduler_harness.py) checks the invariants at every step: token budget,
max_num_seqs, decodes first, disjoint block tables, tokens intact in the fake paged KV cache.
"""

from __future__ import annotations

import math
import random

import pytest
from scheduler_harness import FakeEngine, token

from flashserve.engine.block_manager import peak_blocks
from flashserve.engine.sequence import SequenceStatus


def _random_arrivals(num_seqs: int, max_prompt: int, max_new: int, spread: int):
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for _ in range(num_seqs):
        step = random.randrange(spread)
        lengths = (random.randint(1, max_prompt), random.randint(1, max_new))
        arrivals.setdefault(step, []).append(lengths)
    return arrivals


def _need(arrivals, block_size: int) -> list[int]:
    return [-(-(p + m) // block_size) for seqs in arrivals.values() for p, m in seqs]


@pytest.mark.parametrize("trial", range(4))
def test_random_workload(trial: int) -> None:
    """Sequences arrive over time; all finish with their tokens; nothing leaks."""
    bs = random.choice([1, 4, 16])
    arrivals = _random_arrivals(random.randint(20, 40), 300, 40, spread=60)
    eng = FakeEngine(
        sum(_need(arrivals, bs)),  # room for everyone: no preemption
        block_size=bs,
        max_num_seqs=random.choice([2, 4, 8, 32]),
        max_num_batched_tokens=random.choice([16, 64, 256]),
    )
    eng.run(arrivals)
    eng.check_all_done()
    assert eng.joined_while_running, "no sequence joined a running batch"
    assert not any(out.preempted for out in eng.outputs)


@pytest.mark.parametrize("trial", range(4))
def test_random_workload_with_preemption(trial: int) -> None:
    """A pool that barely holds the longest sequence forces preemptions; all still finish."""
    bs = random.choice([1, 4, 16])
    arrivals = _random_arrivals(random.randint(20, 40), 80, 60, spread=10)
    eng = FakeEngine(
        max(_need(arrivals, bs)) + random.randint(0, 3),
        block_size=bs,
        max_num_seqs=random.choice([4, 8, 32]),
        max_num_batched_tokens=random.choice([16, 64, 256]),
    )
    eng.run(arrivals)
    eng.check_all_done()
    assert sum(len(out.preempted) for out in eng.outputs) > 0
    assert sum(s.num_preemptions for s in eng.seqs) == sum(len(o.preempted) for o in eng.outputs)


@pytest.mark.parametrize("trial", range(4))
def test_random_windowed_workload_longer_than_the_pool(trial: int) -> None:
    """Every layer windowed: in a pool a little larger than what one sequence holds at once,
    sequences many times longer than the pool all finish with their tokens. The harness checks
    at every step that each read of the window finds its token and that each sequence holds
    exactly the blocks from its window's first one on; the short pool forces preemptions."""
    bs = random.choice([1, 4, 16])
    window = random.choice([1, 7, 16, 40])
    budget = random.choice([4, 16, 64])
    arrivals = _random_arrivals(random.randint(8, 20), 300, 200, spread=30)
    eng = FakeEngine(
        peak_blocks(10**6, bs, window, budget) + random.randint(0, 3),
        window=window,
        block_size=bs,
        max_num_seqs=random.choice([2, 4, 32]),
        max_num_batched_tokens=budget,
    )
    longest = max(_need(arrivals, bs))
    eng.run(arrivals)
    eng.check_all_done()
    assert not eng.errored
    assert longest > eng.bm.num_blocks, "no sequence outgrew the pool"


def test_max_num_seqs_one_runs_one_at_a_time() -> None:
    eng = FakeEngine(1000, block_size=4, max_num_seqs=1, max_num_batched_tokens=32)
    seqs = [eng.add(random.randint(1, 50), random.randint(1, 10)) for _ in range(5)]
    eng.run({})
    eng.check_all_done()
    firsts = [next(i for i, o in enumerate(eng.outputs) if s in o.seqs) for s in seqs]
    assert firsts == sorted(firsts) and all(len(o.seqs) == 1 for o in eng.outputs)


def test_new_sequence_joins_running_batch() -> None:
    eng = FakeEngine(100, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = eng.add(5, 10)
    for _ in range(3):
        eng.step()
    b = eng.add(7, 3)
    out = eng.step()
    assert out.seqs == [a, b] and out.num_decodes == 1
    assert [s.num_scheduled_tokens for s in out.seqs] == [0, 0]  # update() ran
    eng.run({})
    eng.check_all_done()


def test_chunked_prefill_alone() -> None:
    eng = FakeEngine(100, block_size=16, max_num_batched_tokens=64)
    seq = eng.add(1000, 1)
    chunks, sampled = [], []
    while eng.sched.has_unfinished:
        out = eng.step()
        chunks.append(out.num_batched_tokens)
        sampled.append(seq.num_output_tokens == 1)
    assert len(chunks) == math.ceil(1000 / 64) == 16
    assert chunks == [64] * 15 + [1000 - 15 * 64]
    assert sampled == [False] * 15 + [True], "must sample on the last chunk only"
    eng.check_all_done()


def test_chunked_prefill_keeps_decodes_running() -> None:
    eng = FakeEngine(200, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    decoders = [eng.add(random.randint(1, 20), 100) for _ in range(3)]
    for _ in range(2):
        eng.step()
    long = eng.add(1000, 2)
    steps = 0
    while long.num_output_tokens == 0:
        out = eng.step()
        steps += 1
        assert out.seqs[:3] == decoders and out.num_decodes == 3, "a decode was stalled"
        left = 1000 - 61 * (steps - 1)
        assert out.seqs[3] is long and out.num_batched_tokens == 3 + min(61, left)
    assert steps == math.ceil(1000 / (64 - 3))
    assert all(d.num_output_tokens == 2 + steps for d in decoders)
    eng.run({})
    eng.check_all_done()


def test_preempts_newest_first() -> None:
    """3 one-block prompts fill a 3-block pool; their first decodes need a block each."""
    eng = FakeEngine(3, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = (eng.add(4, 5) for _ in range(3))
    assert eng.step().seqs == [a, b, c]
    out = eng.step()  # a needs a block: c goes; then b needs one and is itself the newest
    assert out.preempted == [c, b] and out.seqs == [a]
    assert eng.sched.waiting == (b, c) and (b.num_preemptions, c.num_preemptions) == (1, 1)
    eng.run({})
    eng.check_all_done()


def test_abort_waiting_and_running() -> None:
    eng = FakeEngine(50, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    running = eng.add(30, 5)  # takes the whole budget: the next one waits
    waiting = eng.add(10, 5)
    eng.step()
    assert running.block_table and not waiting.block_table
    assert eng.sched.abort(waiting.seq_id) is waiting
    assert eng.sched.abort(running.seq_id) is running
    for seq in (waiting, running):
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
        assert seq.block_table == []
    assert eng.bm.num_free_blocks == 50 and not eng.sched.has_unfinished
    assert eng.sched.abort(running.seq_id) is None and eng.sched.schedule().is_empty


def test_abort_between_schedule_and_update() -> None:
    eng = FakeEngine(50, block_size=4, max_num_batched_tokens=64)
    seqs = [eng.add(random.randint(1, 20), 8) for _ in range(4)]
    out = eng.sched.schedule()
    for s in out.seqs:
        eng._write_kv(s)  # the step ran
    eng.sched.abort(seqs[1].seq_id)
    assert eng.bm.num_free_blocks == 50 - sum(len(s.block_table) for s in out.seqs)
    eng.sched.update(out)
    for s in out.seqs:
        if s is not seqs[1]:
            s.append_token(token(s.seq_id, s.num_tokens))
    eng.run({})
    assert seqs[1].finish_reason == "abort" and eng.bm.num_free_blocks == 50
    assert all(s.num_output_tokens == 8 for s in seqs if s is not seqs[1])


def test_sequence_larger_than_pool_is_finished_with_error() -> None:
    """No livelock: what can never fit in the pool is finished with an error, others go on."""
    eng = FakeEngine(4, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    ok = eng.add(3, 2)
    too_long = eng.add(17, 1)  # 5 blocks, the pool has 4
    grows = eng.add(14, 10)  # fits as a prompt, outgrows the pool while decoding
    out = eng.step()
    assert out.errored == [too_long] and out.seqs == [ok, grows]
    assert too_long.finish_reason == "error" and "5 KV blocks" in too_long.error
    eng.run({}, max_steps=100)
    assert eng.errored == [too_long, grows] and grows.num_output_tokens == 16 - 14 + 1
    assert "17 tokens" in grows.error and ok.num_output_tokens == 2
    eng.check_all_done()


def test_misuse_is_refused() -> None:
    eng = FakeEngine(10, block_size=4)
    seq = eng.add(5, 2)
    with pytest.raises(ValueError, match="already scheduled"):
        eng.sched.add(seq)
    eng.sched.schedule()
    with pytest.raises(RuntimeError, match="call update"):
        eng.sched.schedule()
    eng.sched.finish(seq, "length")
    with pytest.raises(ValueError, match="finished twice"):
        eng.sched.finish(seq, "length")
