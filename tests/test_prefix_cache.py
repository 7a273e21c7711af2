"""Prefix caching: full KV blocks keyed by their prefix, kept once free, reused by later requests.

The block manager's cases check keys, matching, reuse, LRU eviction and reference counts
directly. The scheduler's run on ``FakeEngine``/``AsyncFakeEngine`` (tests/scheduler_harness.py)
over prompts that share prefixes: every step the harness checks reference counts against the
holders, that no cached block is written, that each keyed block holds its writer's tokens and
that every token read is the KV of the same prefix. The engine's run dummy:tiny (fp32, torch
backend) with caching on and off and compare greedy tokens and logprobs.
"""

from __future__ import annotations

import argparse
import random

import pytest
from scheduler_harness import AsyncFakeEngine, FakeEngine

from flashserve.cli.args import add_engine_args, engine_config_from_args
from flashserve.config import EngineConfig
from flashserve.engine.block_manager import BlockError, BlockManager
from flashserve.engine.llm_engine import LLM
from flashserve.engine.sequence import Sequence
from flashserve.sampling.params import SamplingParams

# ---- the block manager ---------------------------------------------------------------------


def _ids(n: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(n)]


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` on what the cache holds and compute all its tokens, as a step would."""
    bm.admit(seq, bm.match(seq), seq.num_tokens - len(bm.match(seq)) * bm.block_size)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.check()


def test_keys_name_the_whole_prefix() -> None:
    bm = BlockManager(16, 4, prefix_caching=True)
    head = _ids(8)
    a, b = Sequence(head + _ids(9)), Sequence(head + _ids(9))
    ka, kb = bm.keys(a, 4), bm.keys(b, 4)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    c = Sequence([head[0] + 1] + head[1:] + a.prompt_token_ids[8:])  # first token differs
    assert all(x != y for x, y in zip(bm.keys(c, 4), ka)), "a key must name its whole prefix"
    d = Sequence(a.prompt_token_ids[4:8] + a.prompt_token_ids[4:8])  # block 1's tokens first
    assert bm.keys(d, 1)[0] != ka[1], "the same tokens after another prefix: another key"
    assert len({*ka, *kb}) == 6


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_reuse_leaves_the_last_token_to_compute(extra: int) -> None:
    """A prompt of 3 full blocks (+ ``extra`` tokens) again: the cached blocks before its last
    token are reused (2 of 3 when the last token ends block 3), its counters start past them."""
    bm = BlockManager(16, 4, prefix_caching=True)
    prompt = _ids(12 + extra)
    a = Sequence(prompt)
    _compute(bm, a)
    assert bm.num_cached_blocks == 3
    b = Sequence(list(prompt))
    hits = bm.match(b)
    assert hits == a.block_table[: 3 if extra else 2]
    assert bm.blocks_to_admit(hits, b.num_tokens - 4 * len(hits)) == 1  # a's held: none idle
    bm.admit(b, hits, b.num_tokens - 4 * len(hits))
    assert b.num_computed_tokens == 4 * len(hits) < b.num_tokens
    assert [bm.ref_count(x) for x in hits] == [2] * len(hits)
    bm.free(a)
    assert [bm.ref_count(x) for x in hits] == [1] * len(hits)
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3, "freed blocks stay cached"
    c = Sequence(list(prompt))
    hits = bm.match(c)
    assert bm.blocks_to_admit(hits, 1) == len(hits) + 1, "idle cached blocks count"


def test_eviction_is_lru_after_blocks_without_keys_and_never_touches_held_blocks() -> None:
    bm = BlockManager(10, 4, prefix_caching=True)
    old, new, held = Sequence(_ids(8)), Sequence(_ids(8)), Sequence(_ids(9))
    for seq in (old, new, held):
        _compute(bm, seq)  # 2 + 2 + 3 blocks, 6 keyed
    old_table, new_table = list(old.block_table), list(new.block_table)
    bm.free(old)
    bm.free(new)  # free: 3 without keys, then old's 2 (least recent), new's 2
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 6
    grab = Sequence(_ids(16))
    bm.admit(grab, [], 16)  # 4 blocks: the 3 without keys, then old's tail block
    assert bm.num_cached_blocks == 5 and old_table[1] in grab.block_table
    assert bm.match(Sequence(old.prompt_token_ids + [1])) == old_table[:1]
    assert bm.match(Sequence(new.prompt_token_ids + [1])) == new_table
    more = Sequence(_ids(12))
    bm.admit(more, [], 12)  # the last 3 free blocks: old's head, then new's two
    assert bm.num_free_blocks == 0 and bm.num_cached_blocks == 2  # held's two keyed blocks
    assert bm.match(Sequence(held.prompt_token_ids)) == held.block_table[:2]
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.admit(Sequence(_ids(1)), [], 1)
    bm.check()


def test_the_same_prefix_computed_twice_at_once_is_keyed_once() -> None:
    bm = BlockManager(16, 4, prefix_caching=True)
    prompt = _ids(9)
    a, b = Sequence(prompt), Sequence(list(prompt))
    bm.admit(a, [], 9)
    a_table = list(a.block_table)
    bm.admit(b, bm.match(b), 9)  # nothing cached yet: b computes its own copy
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_full_blocks(seq)
    assert [bm.key_of(x) is not None for x in a.block_table + b.block_table] == [
        True, True, False, False, False, False]  # fmt: skip
    bm.free(b)
    bm.free(a)
    bm.check()
    assert bm.match(Sequence(prompt)) == a_table[:2]


def test_caching_off_matches_nothing_and_keys_nothing() -> None:
    bm = BlockManager(16, 4)
    prompt = _ids(13)
    _compute(bm, Sequence(prompt))
    assert bm.num_cached_blocks == 0 and bm.match(Sequence(prompt)) == []


def test_stale_hits_and_double_admission_are_refused() -> None:
    bm = BlockManager(4, 4, prefix_caching=True)
    prompt = _ids(9)
    a = Sequence(prompt)
    _compute(bm, a)
    b = Sequence(list(prompt))
    hits = bm.match(b)
    bm.free(a)
    bm.admit(Sequence(_ids(16)), [], 16)  # evicts every cached block
    with pytest.raises(BlockError, match="stale"):
        bm.admit(b, hits, 1)
    c = Sequence(_ids(1))
    with pytest.raises(BlockError, match="already holds"):
        c.block_table.append(0)
        bm.admit(c, [], 1)


# ---- the scheduler -------------------------------------------------------------------------


def _arrivals(num_seqs: int, max_prompt: int, max_new: int, spread: int):
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for _ in range(num_seqs):
        lengths = (random.randint(1, max_prompt), random.randint(1, max_new))
        arrivals.setdefault(random.randrange(spread), []).append(lengths)
    return arrivals


def _with_prefixes(eng: FakeEngine, max_prompt: int) -> FakeEngine:
    eng.prefixes = [_ids(max_prompt) for _ in range(3)]
    return eng


def _blocks(arrivals, bs: int) -> list[int]:
    return [-(-(p + m) // bs) for seqs in arrivals.values() for p, m in seqs]


def _until_a_hit(build) -> FakeEngine:
    """Run draws of ``build()`` (an engine and its arrivals) until one reuses a cached prefix
    (a draw may share no prefix that is still cached when it comes again); every draw is
    checked to the end."""
    for _ in range(10):
        eng, arrivals = build()
        eng.run(arrivals)
        eng.check_all_done()
        sched = eng.sched
        assert sched.prefix_cache_hits <= sched.prefix_cache_queries
        if sched.prefix_cache_hits:
            assert any(s.num_cached_tokens for s in eng.seqs) or any(
                s.num_preemptions for s in eng.seqs
            )
            return eng
    pytest.fail("no draw reused a cached prefix")


@pytest.mark.parametrize("trial", range(3))
def test_random_workload_reuses_prefixes(trial: int) -> None:
    """Prompts that share prefixes arriving over time, a pool with room for everyone: all
    finish with their tokens, the cache is hit, nothing leaks."""

    def build():
        bs = random.choice([1, 4, 16])
        arrivals = _arrivals(random.randint(20, 40), 120, 30, spread=60)
        eng = FakeEngine(sum(_blocks(arrivals, bs)), block_size=bs,
                         max_num_seqs=random.choice([2, 8, 32]),
                         max_num_batched_tokens=random.choice([16, 64, 256]))  # fmt: skip
        return _with_prefixes(eng, 120), arrivals

    _until_a_hit(build)


@pytest.mark.parametrize("trial", range(4))
def test_random_workload_with_eviction_and_preemption(trial: int) -> None:
    """A pool that barely holds the longest sequence: cached blocks are evicted, sequences
    preempted, recompute reuses what is left; all finish right and every block comes back."""

    def build():
        bs = random.choice([1, 4, 8])
        arrivals = _arrivals(random.randint(20, 40), 60, 40, spread=10)
        eng = FakeEngine(max(_blocks(arrivals, bs)) + random.randint(0, 4), block_size=bs,
                         max_num_seqs=random.choice([4, 8, 32]),
                         max_num_batched_tokens=random.choice([16, 64, 256]))  # fmt: skip
        return _with_prefixes(eng, 60), arrivals

    _until_a_hit(build)


@pytest.mark.parametrize("trial", range(3))
def test_random_windowed_workload_reuses_prefixes(trial: int) -> None:
    """With a sliding window: released blocks stay cached, admitted sequences hold only the
    cached blocks their window reads (the harness checks each one's held blocks), and the
    tokens stay right."""

    def build():
        bs = random.choice([1, 4])
        arrivals = _arrivals(random.randint(15, 30), 80, 30, spread=20)
        eng = FakeEngine(sum(_blocks(arrivals, bs)), window=random.choice([3, 8, 17]),
                         block_size=bs, max_num_seqs=8,
                         max_num_batched_tokens=random.choice([8, 32]))  # fmt: skip
        return _with_prefixes(eng, 80), arrivals

    _until_a_hit(build)


@pytest.mark.parametrize("trial", range(4))
def test_look_ahead_with_prefixes_stops_and_aborts(trial: int) -> None:
    """Async scheduling over shared prefixes, with stops, aborts (mid-prefill too) and a pool
    that may be small enough to evict: the look-ahead and the cache stay consistent."""

    def build():
        bs = random.choice([1, 4, 16])
        arrivals = _arrivals(random.randint(10, 30), 60, 40, spread=60)
        pool = random.choice([sum(_blocks(arrivals, bs)), max(_blocks(arrivals, bs)) + 2])
        eng = AsyncFakeEngine(pool, stop_prob=0.03, abort_prob=0.01, block_size=bs,
                              max_num_seqs=random.choice([2, 8, 32]),
                              max_num_batched_tokens=random.choice([16, 64]))  # fmt: skip
        return _with_prefixes(eng, 60), arrivals

    _until_a_hit(build)


def test_caching_off_in_the_scheduler_shares_nothing() -> None:
    arrivals = _arrivals(20, 60, 10, spread=20)
    eng = _with_prefixes(FakeEngine(sum(_blocks(arrivals, 4)), block_size=4,
                                    enable_prefix_caching=False), 60)  # fmt: skip
    eng.run(arrivals)
    eng.check_all_done()
    assert eng.sched.prefix_cache_queries == eng.sched.prefix_cache_hits == 0
    assert eng.bm.num_cached_blocks == 0


# ---- the engine ----------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def _llm(caching: bool, **kwargs) -> LLM:
    given = {"max_num_seqs": 8, "max_kv_tokens": 4096, "async_scheduling": False,
             "device": "cpu", "attention_backend": "torch", **kwargs}  # fmt: skip
    return LLM(EngineConfig(model="dummy:tiny", dtype="float32", enable_prefix_caching=caching,
                            **given))  # fmt: skip


def _waves() -> list[list[list[int]]]:
    """Two waves of prompts: one first, then a batch sharing its prefix (some exactly, some
    within a block, some not at all)."""
    head = [random.randrange(3, 500) for _ in range(70)]
    tail = lambda n: [random.randrange(3, 500) for _ in range(n)]  # noqa: E731
    first = head + tail(9)
    batch = [head + tail(random.randint(1, 20)) for _ in range(4)]
    batch += [list(first), head[:37] + tail(5), tail(30), head[:16]]
    return [[first], batch]


def _run(llm: LLM, waves) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompts in waves:
        out += [(c.token_ids, c.logprobs) for c in llm.generate(prompts, GREEDY)]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return out


OVERRIDES = {"plain": {}, "chunked": {"max_num_batched_tokens": 16},
             "preempting": {"max_kv_tokens": 288, "block_size": 16},
             "async": {"async_scheduling": True},
             "small-blocks": {"block_size": 4, "max_num_batched_tokens": 24}}  # fmt: skip
# on CUDA: the Triton kernels (float32: the same greedy tokens as the torch backend would give),
# eager and under CUDA graphs, async scheduling as on a GPU server
CUDA = {"device": "cuda", "attention_backend": "triton"}
GPU_CASES = [
    pytest.param({**CUDA, **o, "enforce_eager": eager}, id=f"cuda-{name}-{mode}",
                 marks=pytest.mark.gpu)
    for name, o in OVERRIDES.items() for eager, mode in ((True, "eager"), (False, "graphs"))
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [pytest.param(o, id=name) for name, o in OVERRIDES.items()] + GPU_CASES,
)
def test_engine_greedy_same_with_caching_on_and_off(overrides) -> None:
    waves = _waves()
    want = _run(_llm(False, **overrides), waves)
    on = _llm(True, **overrides)
    got = _run(on, waves)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, ref) in zip(got, want):
        assert lp == pytest.approx(ref, abs=1e-4)
    sched = on.engine.scheduler
    assert sched.prefix_cache_hits >= 64, "the second wave reuses the first one's prefix"
    if "max_kv_tokens" in overrides:
        assert sched.num_preemptions > 0


def test_engine_reports_cached_tokens_and_stats() -> None:
    llm = _llm(True)
    engine = llm.engine
    prompt = [random.randrange(3, 500) for _ in range(50)]
    first = [o for o in _outputs(engine, prompt) if o.finished][0]
    second = [o for o in _outputs(engine, prompt) if o.finished][0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48  # 3 blocks of 16
    sched = engine.scheduler
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (100, 48)


def _outputs(engine, prompt: list[int]):
    engine.add_request(prompt, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_engine_abort_mid_prefill_keeps_the_computed_blocks() -> None:
    """A request aborted after two 16-token chunks of its prompt: its two full blocks stay
    cached, the same prompt again reuses them and answers as without caching."""
    prompt = [random.randrange(3, 500) for _ in range(90)]
    want = _llm(False).generate([prompt], GREEDY)[0].token_ids
    llm = _llm(True, max_num_batched_tokens=16)
    engine = llm.engine
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.requests[rid].seq.num_computed_tokens == 32
    engine.abort(rid)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 2
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    assert engine.scheduler.prefix_cache_hits == 32


def test_engine_evicts_under_a_small_pool() -> None:
    """A pool of 8 blocks of 16 and prompts of 3-4 blocks each, one after another: old
    prefixes are evicted, recent ones hit, answers match caching off."""
    prompts = [[random.randrange(3, 500) for _ in range(random.randint(40, 60))] for _ in range(5)]
    order = prompts + [prompts[-1], prompts[0]]
    want = [_llm(False).generate([p], GREEDY)[0].token_ids for p in order]
    llm = _llm(True, max_kv_tokens=128)
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    assert bm.num_blocks == 8
    got = []
    for p in order:
        hits = sched.prefix_cache_hits
        got.append(llm.generate([p], GREEDY)[0].token_ids)
        assert bm.num_cached_blocks <= bm.num_blocks
        gained = sched.prefix_cache_hits - hits
    assert got == want
    assert gained == 0, "the first prompt was evicted long ago"
    assert sched.prefix_cache_hits == 16 * ((len(prompts[-1]) - 1) // 16)  # the repeat only


@pytest.mark.parametrize("flag, want", [([], True), (["--no-prefix-caching"], False),
                                        (["--prefix-caching"], True)])  # fmt: skip
def test_cli_flag(flag: list[str], want: bool) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--device", "cpu", *flag])
    assert engine_config_from_args(args).enable_prefix_caching is want
