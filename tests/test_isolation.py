"""One request that breaks a step fails alone: the engine runs the step again in halves until
the failing rows are by themselves, and every other request of the batch finishes with the
tokens it would have had without the bad one (``LLMEngine.step``, on ``dummy:tiny``)."""

from __future__ import annotations

import random
import threading

import pytest

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM, REQUEST_FAILED
from flashserve.sampling.params import SamplingParams

BAD_SEED = 4242  # the marker of the request whose rows make a step fail


def _llm(**kwargs) -> LLM:
    given = {"max_num_seqs": 8, "max_kv_tokens": 8192, "async_scheduling": False, **kwargs}
    return LLM(EngineConfig(model="dummy:tiny", **given))


def _prompts(n: int) -> list[list[int]]:
    return [[random.randrange(3, 500) for _ in range(random.randint(2, 60))] for _ in range(n)]


def _poison(monkeypatch, llm: LLM, where: str) -> list[int]:
    """Any step whose batch holds the BAD_SEED request raises: in the model runner's execute or
    launch ("forward"), or in the sampler ("sampler"). Returns a list counting the faults."""
    runner, faults = llm.engine.runner, [0]

    def check(seqs) -> None:
        if any(s.params.seed == BAD_SEED for s in seqs):
            faults[0] += 1
            raise IndexError("injected: index -1 is out of bounds")

    if where == "forward":
        execute, launch = runner.execute, runner.launch
        monkeypatch.setattr(runner, "execute", lambda seqs: (check(seqs), execute(seqs))[1])
        monkeypatch.setattr(runner, "launch", lambda seqs, *a: (check(seqs), launch(seqs, *a))[1])
    else:
        prepare = runner.sampler.prepare
        monkeypatch.setattr(runner.sampler, "prepare",
                            lambda seqs, **kw: (check(seqs), prepare(seqs, **kw))[1])  # fmt: skip
    return faults


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_request_that_breaks_its_step_fails_alone(monkeypatch, async_scheduling, where):
    prompts = _prompts(7)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                             ignore_eos=True)  # fmt: skip
    bad = SamplingParams(max_new_tokens=12, temperature=0.8, seed=BAD_SEED, ignore_eos=True)
    params = [greedy, sampled, greedy, greedy, sampled, greedy, greedy]
    expected = [c.token_ids for c in _llm().generate(prompts, params)]

    llm = _llm(async_scheduling=async_scheduling)
    faults = _poison(monkeypatch, llm, where)
    engine = llm.engine
    reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
    for req in reqs[:4]:
        engine.add(req)
    engine.step()
    engine.step()  # the first ones are decoding (and, with async scheduling, one is queued)
    bad_req = engine.make_request(prompts[0], bad)
    engine.add(bad_req)
    for req in reqs[4:]:
        engine.add(req)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()

    assert faults[0] >= 1, "the fault did not fire"
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == [bad_req.request_id]
    assert errors[0].error == REQUEST_FAILED  # no internals for the client
    assert [r.seq.output_token_ids for r in reqs] == expected
    assert all(r.seq.finish_reason == "length" for r in reqs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # and the engine serves again, at full batch
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected


def test_a_request_whose_host_side_fails_fails_alone(monkeypatch):
    """A failure after sampling (detokenizing one request's token) ends that request only."""
    llm = _llm()
    engine = llm.engine
    prompts = _prompts(4)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    expected = [c.token_ids for c in _llm().generate(prompts, params)]
    reqs = [engine.make_request(p, params) for p in prompts]
    victim = engine.make_request(prompts[0], params)

    def broken_add(token_id: int) -> str:
        raise TypeError("injected: the detokenizer broke")

    victim.detokenizer.add = broken_add
    for req in [*reqs[:2], victim, *reqs[2:]]:
        engine.add(req)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == [victim.request_id]
    assert [r.seq.output_token_ids for r in reqs] == expected
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_step_that_fails_for_everyone_fails_everyone_and_the_engine_serves_again(monkeypatch):
    """A fault that is not tied to a request (every attempt fails) ends every request of the
    step with an error, frees their blocks, and leaves the engine able to serve."""
    llm = _llm()
    engine, runner = llm.engine, llm.engine.runner
    execute = runner.execute
    broken = [True]

    def flaky(seqs):
        if broken[0]:
            raise RuntimeError("injected: everything fails")
        return execute(seqs)

    monkeypatch.setattr(runner, "execute", flaky)
    prompts = _prompts(5)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 5 and all(o.finish_reason == "error" for o in outputs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    broken[0] = False
    expected = [c.token_ids for c in _llm().generate(prompts, params)]
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected


def test_a_dead_cuda_context_stops_the_engine_instead_of_retrying(monkeypatch):
    """After a device-side assert every CUDA call fails: retrying rows cannot help, so a failed
    step whose device no longer synchronizes raises EngineDeadError, which ends AsyncLLM's
    thread (its streams get an error, /health turns 503, the server exits for a restart)."""
    import asyncio

    import torch

    from flashserve.config import EngineConfig as Config
    from flashserve.engine.async_llm import AsyncLLM
    from flashserve.engine.llm_engine import EngineDeadError

    llm = AsyncLLM(Config(model="dummy:tiny", max_kv_tokens=4096, async_scheduling=False))
    runner, calls = llm.engine.runner, [0]
    execute = runner.execute

    def assert_on_device(seqs):
        if calls[0] >= 2:
            raise RuntimeError("CUDA error: device-side assert triggered")
        calls[0] += 1
        return execute(seqs)

    def dead_sync(device=None):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(runner, "execute", assert_on_device)
    monkeypatch.setattr(Config, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "synchronize", dead_sync)
    died = []  # the engine thread ends by raising: what it raised
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_type))

    async def one() -> list:
        params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        return [out async for out in llm.generate([5, 6, 7], params)]

    llm.start()
    try:
        outs = asyncio.run(one())
    finally:
        llm.shutdown()
    assert outs[-1].finish_reason == "error" and "EngineDeadError" in outs[-1].error
    assert isinstance(llm.error, EngineDeadError) and died == [EngineDeadError]
    assert calls[0] == 2  # no retry in halves or alone after the device died
