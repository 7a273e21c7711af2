"""Memory follows the window: when every layer of a model is windowed, the blocks that fall wholly
left of a sequence's window go back to the pool, so a sequence holds O(window) blocks and runs
in a pool smaller than itself.

The scheduler cases run on ``FakeEngine`` (tests/scheduler_harness.py), which checks every read
of the window against a fake paged KV cache and each sequence's held blocks at every step. The
engine cases run a tiny random Mistral with a sliding window through the whole engine and
compare its greedy tokens with the same engine over a pool where nothing needs freeing, and with
transformers.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from model_utils import TINY, randomize
from scheduler_harness import AsyncFakeEngine, FakeEngine
from test_loader import save_hf_dir

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.engine.sequence import SequenceStatus
from flashserve.sampling.params import SamplingParams

# ---- the scheduler -------------------------------------------------------------------------


def test_blocks_go_back_at_the_right_step() -> None:
    """Window 8, blocks of 4: after each step the sequence holds the blocks from that of its
    next token's first key (position computed - 7) to that of its last token, no more."""
    eng = FakeEngine(100, window=8, block_size=4, max_num_batched_tokens=64)
    seq = eng.add(10, 12)
    held, released = [], []
    while eng.sched.has_unfinished:
        eng.step()
        held.append(len(seq.held_blocks))
        released.append(seq.num_released_blocks)
    # computed 10 after the prompt, then one more a step: the next token reads from 3, 4, ..
    assert released == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 0]  # 0: finished, table cleared
    assert held == [3, 2, 2, 3, 3, 2, 2, 3, 3, 2, 2, 0]
    assert eng.bm.num_free_blocks == 100
    eng.check_all_done()


def test_chunked_prefill_across_the_window_in_a_pool_smaller_than_the_prompt() -> None:
    """A 30-token prompt in 6-token chunks, window 8, blocks of 4, in a pool of 4 blocks (16
    tokens): each chunk reads the 7 positions before it, across the chunk and block edges."""
    eng = FakeEngine(4, window=8, block_size=4, max_num_batched_tokens=6)
    seq = eng.add(30, 20)
    chunks, released = [], []
    while not seq.num_output_tokens:
        chunks.append(eng.step().num_batched_tokens)
        released.append(seq.num_released_blocks)
    assert chunks == [6] * 5
    # computed 6, 12, 18, 24, 30: the next chunk reads from 0, 5, 11, 17, 23
    assert released == [0, 1, 2, 4, 5] and len(seq.block_table) == 8
    eng.run({})
    assert not eng.errored and seq.num_output_tokens == 20
    eng.check_all_done()


def test_preempted_windowed_sequence_recomputes_everything() -> None:
    """Two windowed sequences outgrow a 5-block pool together (3 blocks each at some steps):
    the newer one is preempted, its released and held blocks are forgotten, and it recomputes
    its whole prompt and outputs through the window before it goes on."""
    eng = FakeEngine(5, window=8, block_size=4, max_num_batched_tokens=8)
    a, b = eng.add(8, 40), eng.add(8, 40)
    eng.run({})
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert not eng.errored
    eng.check_all_done()


def test_never_fits_counts_the_window() -> None:
    """Window 8, blocks of 4, 8-token steps: a sequence holds at most 5 blocks at once
    (positions s - 7 .. s + 7). A 4-block pool runs a sequence of up to 16 tokens and refuses
    longer ones (at once, or when a growing one passes 16), saying why; a 5-block pool runs a
    sequence of any length."""
    eng = FakeEngine(4, window=8, block_size=4, max_num_batched_tokens=8)
    ok = eng.add(3, 2)
    too_long = eng.add(17, 1)
    grows = eng.add(14, 10)
    out = eng.step()
    assert out.errored == [too_long] and "5 KV blocks" in too_long.error
    assert "at once (window 8)" in too_long.error
    eng.run({}, max_steps=100)
    assert eng.errored == [too_long, grows] and ok.num_output_tokens == 2
    eng.check_all_done()
    eng = FakeEngine(5, window=8, block_size=4, max_num_batched_tokens=8)
    seq = eng.add(100, 100)
    eng.run({})
    assert not eng.errored and seq.num_output_tokens == 100
    eng.check_all_done()


def test_look_ahead_steps_release_blocks_when_read() -> None:
    """With async scheduling, a look-ahead step's token counts when it is read, and the
    blocks its window left behind go back then; the next look-ahead step, queued before, reads
    none of them. A pool of 3 blocks, all that positions c - 7 .. c + 1 touch (the window of
    the step in flight and the position of the one queued ahead), runs 80 tokens."""
    eng = AsyncFakeEngine(3, window=8, block_size=4, max_num_batched_tokens=64)
    seq = eng.add(10, 70)
    steps = 0
    while eng.sched.has_unfinished:
        eng.step()
        steps += 1
        if seq.status is SequenceStatus.RUNNING:
            first = max(0, seq.num_computed_tokens - 7) // 4
            assert seq.num_released_blocks == first
    assert len(eng.aheads) > 50 and steps < 75, "the look-ahead did not keep up"
    eng.check_all_done()


# ---- the engine ----------------------------------------------------------------------------

WINDOW = 16


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A tiny random Mistral whose every layer has a 16-token window, as a Hugging Face
    directory, and the transformers model it was written from."""
    path = tmp_path_factory.mktemp("mistral-window")
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    randomize(hf, seed=random.randrange(2**31))
    save_hf_dir(hf, path)
    hf.generation_config.eos_token_id = None  # ours ignore EOS: so must transformers' generate
    return str(path), hf.eval()


def _engine(path: str, **overrides) -> LLM:
    return LLM(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, **overrides))


def _prompts(n: int) -> list[list[int]]:
    return [[random.randrange(3, 500) for _ in range(40)] for _ in range(n)]


GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_engine_greedy_in_a_pool_smaller_than_a_sequence(windowed_model, async_scheduling):
    """Prompts of 40 tokens and 40 generated (20 blocks of 4 each) in a pool of 10 blocks,
    8-token steps (prefill chunks crossing the window): the same greedy tokens as an engine
    whose pool holds everything, and as transformers; blocks come back, preemptions happen."""
    path, hf = windowed_model
    prompts = _prompts(3)
    big = _engine(path)
    want = [c.token_ids for c in big.generate(prompts, GREEDY)]
    small = _engine(path, max_kv_tokens=40, max_num_batched_tokens=8, max_num_seqs=4,
                    async_scheduling=async_scheduling)  # fmt: skip
    bm = small.engine.block_manager
    assert bm.num_blocks == 10 and bm.window == WINDOW
    assert small.engine.max_model_len == TINY["max_position_embeddings"], "capped by the pool"
    got = [c.token_ids for c in small.generate(prompts, GREEDY)]
    assert got == want
    assert small.engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks
    with torch.no_grad():
        for prompt, tokens in zip(prompts, want):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
            assert ref[0, len(prompt) :].tolist() == tokens


def test_engine_kv_usage_counts_held_blocks(windowed_model) -> None:
    """KV usage, step by step, is the share of the pool the running sequences hold, and one
    sequence never holds more than the window and a step need."""
    path, _ = windowed_model
    llm = _engine(path, max_kv_tokens=64, max_num_batched_tokens=8)
    engine, bm = llm.engine, llm.engine.block_manager
    for prompt in _prompts(2):
        engine.add_request(prompt, GREEDY)
    peak = bm.peak_blocks(10**6, 8)  # (15 + 8 + 2) // 4 + 1 = 7
    assert peak == 7
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        held = sum(len(s.held_blocks) for s in running)
        assert bm.usage() == pytest.approx(held / bm.num_blocks)
        assert all(len(s.held_blocks) <= peak for s in running)
    assert bm.usage() == 0.0


def test_engine_pool_smaller_than_the_window_caps_max_model_len(windowed_model) -> None:
    """A pool of 6 blocks cannot hold a window and a step (7): the context length falls back
    to the pool's 24 tokens, as without a window; a pool of 7 keeps the model's 128."""
    path, _ = windowed_model
    llm = _engine(path, max_kv_tokens=24, max_num_batched_tokens=8)
    assert llm.engine.max_model_len == 24
    assert _engine(path, max_kv_tokens=28, max_num_batched_tokens=8).engine.max_model_len == 128
