"""Sampler: greedy, exact sampling distribution, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from flashserve.engine.sequence import Sequence
from flashserve.sampling.noise import (
    exponential_from_bits_,
    exponential_noise,
    hash32_,
    row_keys,
)
from flashserve.sampling.params import InvalidParam, SamplingParams
from flashserve.sampling.sampler import Sampler, apply_penalties

M32 = 0xFFFFFFFF


def seq(
    prompt_len: int = 3, outputs: list[int] | None = None, vocab: int = 50, **params
) -> Sequence:
    """A sequence with a random prompt, the given output tokens and a random seed by default."""
    params.setdefault("seed", random.getrandbits(63))
    s = Sequence([random.randrange(vocab) for _ in range(prompt_len)], SamplingParams(**params))
    for t in outputs or []:
        s.append_token(t)
    return s


def sample(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], **changes):
    batch = sampler.prepare(seqs)
    return sampler(logits, dataclasses.replace(batch, **changes))


def many_seeds(n: int, vocab: int, **params) -> list[Sequence]:
    return [seq(prompt_len=1 + i % 5, vocab=vocab, **params) for i in range(n)]


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the token counts against probs [V] (over tokens with probs > 0)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "picked a token of probability 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def chi2_limit(df: int, z: float = 5.5) -> float:
    """Upper tail bound of chi-square(df) at z sigmas (Wilson-Hilferty); p ~ 2e-8 at z = 5.5."""
    if df == 0:
        return 0.0
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi2(tokens, probs), int((probs > 0).sum()) - 1
    limit = chi2_limit(df)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert stat <= limit, f"chi2 {stat:.1f} >= {limit:.1f}\ncounts {counts}\nexpected {probs}"


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_hash32_matches_python_integers():
    values = [0, 1, 2**31 - 1, 2**31, M32] + [random.getrandbits(32) for _ in range(2000)]
    got = hash32_(torch.tensor(values, dtype=torch.int64)).tolist()
    want = [lowbias32(v) for v in values]
    bad = [(v, g, w) for v, g, w in zip(values, got, want) if g != w]
    assert not bad, f"{len(bad)} mismatches, first (in, got, want): {bad[:3]}"


def test_noise_matches_python_integers():
    v, n = 300, 4
    seeds = [random.getrandbits(63) for _ in range(n)]
    steps = [random.getrandbits(31) for _ in range(n)]
    got = exponential_noise(torch.tensor(seeds), torch.tensor(steps), hash32_(torch.arange(v)))
    for seed, step, row in zip(seeds, steps, got):
        key = lowbias32(lowbias32(lowbias32(seed >> 32) ^ (seed & M32)) ^ step)
        bits = [lowbias32(lowbias32(i) ^ key) for i in range(v)]
        u = (torch.tensor(bits, dtype=torch.float64) // 512 + 0.5) / 2**23
        torch.testing.assert_close(row, -u.float().log(), rtol=0, atol=0)


def test_noise_is_exponential():
    n, v = 200, 1000
    seed = torch.randint(0, 2**62, (n,))
    step = torch.randint(0, 2**31, (n,))
    e = exponential_noise(seed, step, hash32_(torch.arange(v))).flatten().double().sort().values
    cdf = 1 - torch.exp(-e)
    ideal = (torch.arange(e.numel(), dtype=torch.float64) + 0.5) / e.numel()
    ks = float((cdf - ideal).abs().max())
    assert ks < 2.8 / math.sqrt(e.numel()), f"KS distance {ks}"
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())


def test_noise_is_positive_and_finite_at_the_extreme_hashes():
    bits = torch.tensor([0, 1, 511, 512, 2**31, M32 - 512, M32 - 511, M32])
    e = exponential_from_bits_(bits)
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all()), f"noise {e}"


@pytest.mark.parametrize("n,v", [(1, 1), (5, 17), (9, 1000)])
def test_greedy_equals_argmax(n, v):
    logits = torch.randn(n, v) * 3
    out = Sampler(v, "cpu")(
        logits, Sampler(v, "cpu").prepare([seq(temperature=0.0) for _ in range(n)])
    )
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_mixed_greedy_and_sampled_rows():
    v, sampler = 40, Sampler(40, "cpu")
    seqs = [
        seq(temperature=random.choice([0.0, 0.8, 1.3]), top_k=random.choice([-1, 5]))
        for _ in range(30)
    ]
    logits = torch.randn(30, v)
    out = sampler(logits, sampler.prepare(seqs))
    for i, s in enumerate(seqs):
        if s.params.temperature == 0.0:
            assert out.token_ids[i] == logits[i].argmax(), f"greedy row {i}"
        else:
            alone = sampler(logits[i : i + 1], sampler.prepare([s])).token_ids[0]
            assert out.token_ids[i] == alone, f"sampled row {i}"
    assert not torch.equal(out.token_ids, logits.argmax(-1)), "sampled rows all picked argmax"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax(temperature):
    n, v = 20000, 8
    logits = torch.randn(v) * 1.2
    seqs = many_seeds(n, v, temperature=temperature)
    tokens = Sampler(v, "cpu")(logits.expand(n, v), Sampler(v, "cpu").prepare(seqs)).token_ids
    assert_distribution(tokens, (logits / temperature).softmax(-1))
    if temperature != 1.0:  # the test can tell temperatures apart
        assert chi2(tokens, logits.softmax(-1)) > chi2_limit(v - 1)


def test_one_seed_over_many_steps_follows_softmax():
    n, v = 20000, 8
    logits = torch.randn(v)
    sampler = Sampler(v, "cpu")
    seqs = [seq(seed=random.getrandbits(63))] * n
    tokens = sample(sampler, logits.expand(n, v), seqs, step=torch.arange(n) + 5).token_ids
    assert_distribution(tokens, logits.softmax(-1))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: mask [V] of the smallest set, best first, whose mass reaches top_p."""
    order = probs.double().sort(descending=True)
    keep = order.values.cumsum(0) - order.values < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter(0, order.indices, keep)


def allowed_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Reference filter of one row [V]: top-k, then nucleus, then min-p."""
    mask = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.numel():
        mask &= logits >= logits.topk(top_k).values[-1]
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    if top_p < 1.0:
        mask &= nucleus(probs, top_p)
    return mask & (probs >= min_p * probs.max())


def safe_top_p(probs: torch.Tensor) -> float:
    """A top_p half way between two cumulative sums: far from float rounding at the boundary.

    probs [V] need not be normalised; at least two must be > 0.
    """
    cum = (probs.double() / probs.sum()).sort(descending=True).values.cumsum(0)
    i = random.randrange(0, min(5, int((probs > 0).sum()) - 1))
    return float((cum[i] + cum[i + 1]) / 2)


def safe_min_p(probs: torch.Tensor) -> float:
    """A min_p half way (geometrically) between two probability ratios to the max."""
    ratios = (probs / probs.max()).double().sort(descending=True).values
    i = random.randrange(1, min(6, probs.numel() - 1))
    return float((ratios[i] * ratios[i + 1]).sqrt())


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p", "all"])
def test_filters_keep_exactly_the_allowed_tokens(kind):
    n, v = 8000, 30
    logits = torch.randn(v) * 0.7
    probs = logits.softmax(-1)
    top_k = random.randint(3, 10) if kind in ("top_k", "all") else -1
    top_p = (
        safe_top_p(allowed_mask(logits, top_k, 1.0, 0.0) * probs)
        if kind in ("top_p", "all")
        else 1.0
    )
    min_p = safe_min_p(probs) if kind == "min_p" else 0.0
    allowed = allowed_mask(logits, top_k, top_p, min_p)
    seqs = many_seeds(n, v, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = Sampler(v, "cpu")(logits.expand(n, v), Sampler(v, "cpu").prepare(seqs)).token_ids
    picked = torch.bincount(tokens, minlength=v) > 0
    assert not (picked & ~allowed).any(), f"picked excluded {torch.where(picked & ~allowed)}"
    assert (picked == allowed).all(), f"never picked {torch.where(allowed & ~picked)}"
    assert_distribution(tokens, probs * allowed / (probs * allowed).sum())


def test_rows_with_different_filters_in_one_batch():
    v, per_config = 64, 600
    configs = [
        dict(top_k=4),
        dict(top_k=-1),
        dict(top_p=0.5),
        dict(top_k=100),
        dict(top_k=9, top_p=0.8, min_p=0.2),
        dict(temperature=0.0),
        dict(min_p=0.5),
    ]
    seqs = [seq(vocab=v, **c) for _ in range(per_config) for c in configs]
    logits = torch.randn(len(seqs), v) * 2
    out = Sampler(v, "cpu")(logits, Sampler(v, "cpu").prepare(seqs))
    for i, s in enumerate(seqs):
        p = s.params
        ok = allowed_mask(logits[i], p.top_k, p.top_p, p.min_p)
        if p.temperature == 0.0:
            ok = torch.arange(v) == logits[i].argmax()
        assert ok[out.token_ids[i]], f"row {i} ({p}) picked excluded token {out.token_ids[i]}"


def test_tiny_top_p_keeps_the_best_token():
    n, v = 200, 100
    logits = torch.randn(n, v)
    tokens = Sampler(v, "cpu")(logits, Sampler(v, "cpu").prepare(many_seeds(n, v, top_p=1e-6)))
    assert torch.equal(tokens.token_ids, logits.argmax(-1))


def test_zero_top_p_on_the_device_picks_the_best_token_instead_of_indexing_out_of_bounds():
    """A row whose top_p reaches the device as 0 (SamplingParams refuses it, but the sampler must
    not trust that: on CUDA an index of -1 is a device-side assert) keeps its best token, and
    the other rows of the batch sample as they would alone."""
    n, v = 8, 64
    logits = torch.randn(n, v)
    seqs = many_seeds(n, v, top_p=0.9)
    sampler = Sampler(v, "cpu")
    alone = sampler(logits, sampler.prepare(seqs)).token_ids
    batch = sampler.prepare(seqs)
    top_p = batch.top_p.clone()
    top_p[3] = 0.0
    out = sampler(logits, dataclasses.replace(batch, top_p=top_p))
    assert out.token_ids[3] == logits[3].argmax()
    others = [i for i in range(n) if i != 3]
    assert torch.equal(out.token_ids[others], alone[others])


def test_nan_logits_in_one_row_leave_the_other_rows_alone():
    n, v = 6, 40
    logits = torch.randn(n, v)
    seqs = many_seeds(n, v, top_p=0.8, top_k=10)
    sampler = Sampler(v, "cpu")
    alone = sampler(logits, sampler.prepare(seqs)).token_ids
    bad = logits.clone()
    bad[2] = float("nan")
    out = sampler(bad, sampler.prepare(seqs))
    assert 0 <= out.token_ids[2] < v
    others = [i for i in range(n) if i != 2]
    assert torch.equal(out.token_ids[others], alone[others])


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1e-46),  # 0.0 in float32
        ("temperature", 1e39),  # inf in float32
        ("repetition_penalty", 1e-46),
        ("repetition_penalty", 1e39),
        ("repetition_penalty", 1e-40),  # a float32 subnormal: logits / r overflow
        ("top_p", 0.0),
        ("min_p", 1.5),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", -2.5),
    ],
)
def test_sampling_values_are_checked_as_the_device_sees_them(field, value):
    with pytest.raises(InvalidParam, match=field) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 1e-46), ("min_p", 1e-46), ("presence_penalty", 1e-46), ("top_p", 1e-30)],
)
def test_values_that_round_harmlessly_in_float32_are_served(field, value):
    params = SamplingParams(**{field: value})
    assert getattr(params, field) == value


def test_one_rule_for_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-46).greedy  # would overflow a float32 division
    assert not SamplingParams(temperature=1e-4).greedy


def penalised_reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Direct per-row implementation of the penalties."""
    out = logits.clone()
    for i, s in enumerate(seqs):
        p, row = s.params, out[i]
        seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
        for t in set(s.output_token_ids):
            count = s.output_token_ids.count(t)
            row[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def penalty_batch(n: int, v: int) -> list[Sequence]:
    def one():
        return seq(
            prompt_len=random.randint(1, 20),
            outputs=[random.randrange(v) for _ in range(random.randint(0, 30))],
            vocab=v,
            temperature=0.0,
            repetition_penalty=random.choice([1.0, 0.7, 1.3, 2.0]),
            presence_penalty=random.choice([0.0, 0.5, -1.0]),
            frequency_penalty=random.choice([0.0, 0.3, -0.2]),
        )

    return [one() for _ in range(n)]


def test_penalties_match_reference():
    n, v = 12, 25
    seqs, sampler = penalty_batch(n, v), Sampler(v, "cpu")
    for step in range(4):  # the sampler caches token arrays: they must follow appended tokens
        logits = torch.randn(n, v) * 3
        batch = sampler.prepare(seqs)
        got = apply_penalties(logits, batch.penalties)
        want = penalised_reference(logits, seqs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        assert torch.equal(sampler(logits, batch).token_ids, got.argmax(-1))
        for s in random.sample(seqs, n // 2):
            for _ in range(random.randint(1, 40)):
                s.append_token(random.randrange(v))


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    v = 40
    for _ in range(10):
        s = seq(prompt_len=7, outputs=[random.randrange(v) for _ in range(5)], vocab=v)
        s.params.repetition_penalty = random.uniform(0.5, 2.0)
        logits = torch.randn(1, v) * 3
        proc = transformers.RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty)
        want = proc(torch.tensor([s.token_ids]), logits.clone())
        got = apply_penalties(logits, Sampler(v, "cpu").prepare([s]).penalties)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_penalty_inputs_without_penalties():
    batch = Sampler(10, "cpu").prepare([seq(outputs=[1, 2], vocab=10) for _ in range(4)])
    assert batch.penalties is None


def test_same_seed_and_step_give_the_same_token_in_any_batch():
    v, sampler = 1000, Sampler(1000, "cpu")
    target, row = seq(vocab=v, temperature=1.0), torch.randn(v) * 0.1  # near uniform: noise rules
    alone = sampler(row[None], sampler.prepare([target])).token_ids[0]
    others = [
        seq(vocab=v, temperature=random.choice([0.0, 0.7, 1.0]), top_k=random.choice([-1, 3]),
            top_p=random.choice([1.0, 0.9]), repetition_penalty=random.choice([1.0, 1.2]),
            logprobs=random.choice([None, 2]))
        for _ in range(15)
    ]  # fmt: skip
    pos = random.randrange(16)
    seqs = others[:pos] + [target] + others[pos:]
    logits = torch.randn(16, v)
    logits[pos] = row
    out = sampler(logits, sampler.prepare(seqs)).token_ids
    assert out[pos] == alone, f"alone {alone}, in a batch at {pos}: {out[pos]}"
    perm = torch.randperm(16)
    permuted = sampler(logits[perm], sampler.prepare([seqs[i] for i in perm])).token_ids
    assert torch.equal(permuted, out[perm]), f"order changed tokens: {permuted} vs {out[perm]}"


def stream(sampler: Sampler, logits: torch.Tensor, seed: int, steps: int) -> list[int]:
    s = seq(seed=seed)
    return sample(
        sampler, logits.expand(steps, -1), [s] * steps, step=torch.arange(steps)
    ).token_ids.tolist()


def test_different_seeds_give_different_streams():
    v, sampler = 1000, Sampler(1000, "cpu")
    logits = torch.zeros(v)
    a, b = random.getrandbits(63), random.getrandbits(63)
    sa, sb = stream(sampler, logits, a, 50), stream(sampler, logits, b, 50)
    assert sa == stream(sampler, logits, a, 50), "same seed, different stream"
    assert sum(x == y for x, y in zip(sa, sb)) < 5, f"seeds {a}, {b} share tokens: {sa} {sb}"
    assert len(set(sa)) > 40, f"one seed's stream repeats: {sa}"


def test_logprobs_are_raw_log_softmax_at_the_chosen_tokens():
    n, v = 10, 60
    seqs = penalty_batch(n, v)
    for s in seqs:
        s.params.temperature = random.choice([0.0, 0.5, 1.5])
        s.params.logprobs = random.choice([None, 0, 3, 5])
    logits = torch.randn(n, v) * 2
    out = Sampler(v, "cpu")(logits, Sampler(v, "cpu").prepare(seqs))
    logp = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, logp.gather(1, out.token_ids[:, None]).squeeze(1))
    k = max(s.params.logprobs or 0 for s in seqs)
    if k == 0:
        assert out.top_ids is None
        return
    want = logp.topk(k)
    assert out.top_ids.shape == (n, k)
    torch.testing.assert_close(out.top_logprobs, want.values)
    torch.testing.assert_close(logp.gather(1, out.top_ids), out.top_logprobs)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()), "not sorted"


def test_no_top_logprobs_when_nobody_asks():
    v = 20
    out = Sampler(v, "cpu")(torch.randn(3, v), Sampler(v, "cpu").prepare([seq() for _ in range(3)]))
    assert out.top_ids is None and out.top_logprobs is None


def test_logits_are_not_modified():
    n, v = 6, 30
    logits = torch.randn(n, v)
    before = logits.clone()
    seqs = penalty_batch(n, v)
    for s in seqs:
        s.params.temperature, s.params.top_p, s.params.min_p = 0.9, 0.8, 0.05
    Sampler(v, "cpu")(logits, Sampler(v, "cpu").prepare(seqs))
    assert torch.equal(logits, before)


@pytest.mark.gpu
def test_cuda_matches_cpu_without_syncs():
    n, v = 64, 32000
    seqs = penalty_batch(n, v)
    for s in seqs:
        s.params.temperature = random.choice([0.0, 0.7, 1.0])
        s.params.top_k, s.params.top_p = random.choice([-1, 50]), random.choice([1.0, 0.9])
        s.params.min_p, s.params.logprobs = random.choice([0.0, 0.05]), random.choice([None, 4])
    logits = torch.randn(n, v) * 0.5
    cpu = Sampler(v, "cpu")
    gpu = Sampler(v, "cuda")
    seed, step = torch.randint(0, 2**62, (n,)), torch.randint(0, 2**31, (n,))
    bits = hash32_(cpu._vocab_hash[None] ^ row_keys(seed, step)[:, None])
    bits_gpu = hash32_(gpu._vocab_hash[None] ^ row_keys(seed.cuda(), step.cuda())[:, None])
    assert torch.equal(bits_gpu.cpu(), bits), "integer noise bits differ between CPU and CUDA"
    torch.testing.assert_close(
        gpu._noise(seed.cuda(), step.cuda(), gpu._vocab_hash).cpu(),
        exponential_noise(seed, step, cpu._vocab_hash),
        rtol=1e-6, atol=0,
    )  # fmt: skip
    batch, logits_gpu = gpu.prepare(seqs), logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():  # as the runner calls it (and the noise was compiled)
            out = gpu(logits_gpu, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the next upload refills (and regrows) the staging while that step may still run: its
    # copy is queued after the step's kernels, and the step's inputs stay as they were sent
    gpu.prepare(penalty_batch(3 * n, v))
    want = cpu(logits, cpu.prepare(seqs))
    assert torch.equal(out.token_ids.cpu(), want.token_ids)
    torch.testing.assert_close(out.top_logprobs.cpu(), want.top_logprobs)
