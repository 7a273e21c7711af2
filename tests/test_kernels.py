"""Triton kernels against the plain-torch reference (kernels/reference.py) on float64 copies.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
anything imports Triton) on CPU tensors, at small sizes, with fp16 and fp32 operands only: the
interpreter miscomputes tl.dot on bf16 operands. With a GPU the same tests run on it. Every
output is poisoned with NaN before the kernel runs, so unwritten elements fail the check.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import assert_close  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.decode import DecodeTuning, decode_attention  # noqa: E402
from kernels.prefill import prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}


# ---------------------------------------------------------------- helpers


class Paged:
    """A random paged KV cache holding ``lens[b]`` tokens per sequence in shuffled blocks."""

    def __init__(self, lens, hkv, d, page, dtype, shuffle=True, spare_blocks=3):
        self.lens = list(lens)
        self.page = page
        need = [-(-n // page) for n in self.lens]
        width = max(max(need), 1) + 1
        total = sum(need) + spare_blocks
        self.k = torch.randn(total, page, hkv, d, device=DEVICE).to(dtype)
        self.v = torch.randn(total, page, hkv, d, device=DEVICE).to(dtype)
        ids = torch.randperm(total) if shuffle else torch.arange(total)
        self.block_tables = torch.zeros(len(self.lens), width, dtype=torch.int32)
        pos = 0
        for b, n in enumerate(need):
            self.block_tables[b, :n] = ids[pos : pos + n].int()
            pos += n
        self.block_tables = self.block_tables.to(DEVICE)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=DEVICE)

    def contiguous_copy(self):
        """The same logical KV with every sequence's blocks in order, in a fresh pool."""
        other = Paged.__new__(Paged)
        other.lens, other.page = self.lens, self.page
        rows = [self.block_tables[b, : -(-n // self.page)].long() for b, n in enumerate(self.lens)]
        order = torch.cat(rows)
        other.k, other.v = self.k[order].clone(), self.v[order].clone()
        other.block_tables = torch.zeros_like(self.block_tables)
        pos = 0
        for b, r in enumerate(rows):
            other.block_tables[b, : len(r)] = torch.arange(pos, pos + len(r), device=DEVICE)
            pos += len(r)
        other.seq_lens = self.seq_lens
        return other


def decode_ref(q, kv: Paged, scale):
    return reference.decode_attention(
        q.double(), kv.k.double(), kv.v.double(), kv.seq_lens, kv.block_tables, scale,
        return_lse=True,
    )  # fmt: skip


def prefill_ref(q, kv: Paged, cu, scale):
    return reference.prefill_attention(
        q.double(), kv.k.double(), kv.v.double(), cu, kv.seq_lens, kv.block_tables, scale,
        return_lse=True,
    )  # fmt: skip


def run_decode(q, kv: Paged, scale, **kw):
    out = torch.full_like(q, float("nan"))
    out, lse = decode_attention(
        q, kv.k, kv.v, kv.seq_lens, kv.block_tables, scale, max_seq_len=max(kv.lens), out=out,
        return_lse=True, **kw,
    )  # fmt: skip
    return out, lse


def run_prefill(q, kv: Paged, cu, scale, **kw):
    out = torch.full_like(q, float("nan"))
    qlens = (cu[1:] - cu[:-1]).tolist()
    out, lse = prefill_attention(
        q, kv.k, kv.v, cu, kv.seq_lens, kv.block_tables, scale, max_query_len=max(qlens),
        max_seq_len=max(kv.lens), out=out, return_lse=True, **kw,
    )  # fmt: skip
    return out, lse


def cu_of(qlens):
    return torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)  # fmt: skip


# ---------------------------------------------------------------- decode

DECODE_CASES = [  # (dtype, hq, hkv, d, lens, page)
    (torch.float16, 4, 4, 64, [1, 17, 1000, 130], 16),
    (torch.float32, 6, 2, 64, [17, 1, 300], 16),
    (torch.float16, 8, 2, 128, [1000, 1, 63], 32),
    (torch.float16, 8, 1, 128, [65, 200], 16),
    (torch.float32, 4, 1, 128, [129, 1], 64),
    (torch.float16, 6, 2, 96, [77, 300], 16),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,lens,page", DECODE_CASES)
def test_decode_matches_reference(dtype, hq, hkv, d, lens, page):
    kv = Paged(lens, hkv, d, page, dtype)
    q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
    scale = d**-0.5
    out, lse = run_decode(q, kv, scale)
    ref_out, ref_lse = decode_ref(q, kv, scale)
    assert_close(out, ref_out, TOL[dtype], "decode out")
    assert_close(lse, ref_lse, LSE_TOL[dtype], "decode lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_split_vs_no_split(dtype):
    lens, hq, hkv, d = [1000, 17, 1, 256], 8, 2, 64
    kv = Paged(lens, hkv, d, 16, dtype)
    q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
    ref_out, ref_lse = decode_ref(q, kv, 0.125)
    one, lse1 = run_decode(q, kv, 0.125, num_splits=1)
    for kw in ({"num_splits": 7}, {"num_splits": 40}, {"split_size": 128}):
        many, lse_many = run_decode(q, kv, 0.125, **kw)
        assert_close(many, ref_out, TOL[dtype], f"decode out {kw}")
        assert_close(lse_many, ref_lse, LSE_TOL[dtype], f"decode lse {kw}")
        assert_close(many, one.double(), TOL[dtype], f"decode {kw} vs one split")
    assert_close(one, ref_out, TOL[dtype], "decode out, one split")
    assert_close(lse1, ref_lse, LSE_TOL[dtype], "decode lse, one split")


@pytest.mark.parametrize("d, page", [(64, 16), (96, 16), (64, 128)])
def test_decode_at_page_and_tile_edges(d, page):
    """Lengths that end inside a page, inside a tile, on a tile edge, with empty splits and a
    length of 1; pages shorter and longer than the KV tile (entries loaded once per page)."""
    lens = [1, 17, 64, 128, 1000, 333]
    kv = Paged(lens, 2, d, page, torch.float16)
    q = torch.randn(len(lens), 8, d, device=DEVICE).half()
    ref_out, ref_lse = decode_ref(q, kv, d**-0.5)
    for kw in ({"num_splits": 1}, {"num_splits": 6}, {"split_size": 192},
               {"num_splits": 3, "tuning": DecodeTuning(tiles=(128, 4, 2))}):  # fmt: skip
        out, lse = run_decode(q, kv, d**-0.5, **kw)
        assert_close(out, ref_out, TOL[torch.float16], f"decode out {kw}")
        assert_close(lse, ref_lse, LSE_TOL[torch.float16], f"decode lse {kw}")


TUNINGS = [  # each changes what the split heuristic or the launch does
    DecodeTuning(tiles=(32, 4, 2)),
    DecodeTuning(programs_per_sm=1, max_splits=3),
    DecodeTuning(min_split_tokens=64, short_split_tokens=0),
    DecodeTuning(pdl=False),
]


@pytest.mark.parametrize("tuning", TUNINGS, ids=str)
def test_decode_tunings_match_the_reference(tuning):
    lens = [1, 300, 1000, 65]
    kv = Paged(lens, 2, 64, 16, torch.float16)
    q = torch.randn(len(lens), 8, 64, device=DEVICE).half()
    ref_out, ref_lse = decode_ref(q, kv, 0.125)
    for max_len in (1000, 4096):  # the heuristic's split count and minimum split length
        out = torch.full_like(q, float("nan"))
        out, lse = decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.125,
                                    max_seq_len=max_len, out=out, return_lse=True,
                                    tuning=tuning)  # fmt: skip
        assert_close(out, ref_out, TOL[torch.float16], f"{tuning} max_seq_len {max_len}")
        assert_close(lse, ref_lse, LSE_TOL[torch.float16], f"lse {tuning} {max_len}")


def test_decode_plan_runs_short_splits_with_one_stage_fewer():
    """Splits of at most ``short_split_tokens`` get (BLOCK_N, warps, stages - 1), longer ones
    the default; explicit tiles are never changed. The result is the same (GPU test)."""
    from kernels.decode import decode_config, num_splits_for, plan_splits

    base = decode_config(64)
    for max_len, sms in ((4096, 132), (8192, 132), (65536, 132), (65536, 1)):
        plan = plan_splits(1, 2, 64, 2, max_len, sms)
        assert plan.splits == num_splits_for(1, 2, max_len, sms, base[0], 2), (max_len, sms)
        short = -(-max_len // plan.splits) <= DecodeTuning().short_split_tokens
        assert plan.tiles == ((base[0], base[1], base[2] - 1) if short else base), (max_len, sms)
    assert plan_splits(1, 2, 64, 2, 4096, 132, DecodeTuning(tiles=base)).tiles == base
    never = DecodeTuning(short_split_tokens=0)
    assert plan_splits(1, 2, 64, 2, 4096, 132, never).tiles == base


def test_decode_tuning_sizes_the_splits():
    """Each split-sizing field moves the plan as documented (B=1, 2 KV heads, 132 SMs, head
    dim 64, fp16)."""
    from kernels.decode import plan_splits

    def plan(max_len, **fields):
        return plan_splits(1, 2, 64, 2, max_len, 132, DecodeTuning(**fields))

    default = plan(65536)
    assert default.splits == 128 and default.min_split == 256  # 2 per SM x 132 / 2 heads
    assert plan(65536, programs_per_sm=1).splits == 64
    assert plan(65536, max_splits=16).splits == 16
    assert plan(4096).splits == 16  # 4K / 256-token splits
    assert plan(4096, min_split_tokens=512).splits == 8
    assert plan(4096, min_split_tokens=512).min_split == 512
    assert plan(4096, min_split_tokens=100).min_split == 128  # whole tiles of 64


@pytest.mark.parametrize(
    "fields, message",
    [({"tiles": (48, 4, 3)}, "tiles"), ({"tiles": (8, 4, 3)}, "tiles"),
     ({"tiles": (64, 3, 3)}, "tiles"), ({"tiles": (64, 4, 0)}, "tiles"),
     ({"tiles": (64, 4)}, "tiles"), ({"programs_per_sm": 0}, "programs_per_sm"),
     ({"min_split_tokens": 0}, "min_split_tokens"), ({"max_splits": 0}, "max_splits"),
     ({"short_split_tokens": -1}, "short_split_tokens")],
)  # fmt: skip
def test_decode_tuning_rejects_what_the_kernel_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodeTuning(**fields)


def test_decode_tuning_is_a_frozen_value():
    """Passed around and compared, never changed in place; tiles given as a list are a tuple."""
    import dataclasses

    tuning = DecodeTuning(tiles=[64, 4, 3])
    assert tuning.tiles == (64, 4, 3) and tuning == DecodeTuning(tiles=(64, 4, 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.pdl = False


def test_decode_remembers_a_refused_pdl_launch(monkeypatch):
    """A Triton whose launcher refuses PDL: the first launch warns and runs plainly, and later
    launches on that device go plainly at once; ``pdl=False`` never asks. ``chain=`` reaches
    the launch."""
    from kernels import decode

    monkeypatch.setattr(decode, "pdl_wait", lambda device: True)  # as on sm_90+
    monkeypatch.setattr(decode, "_PDL_REFUSED", set())
    real, asked = decode._launch, []

    def launch(*args, pdl):
        chain = args[-1]
        asked.append((pdl, chain))
        if pdl:
            raise RuntimeError("launch_pdl: unexpected keyword")
        real(*args, pdl=False)

    monkeypatch.setattr(decode, "_launch", launch)
    kv = Paged([300, 17], 2, 64, 16, torch.float16)
    q = torch.randn(2, 4, 64, device=DEVICE).half()
    ref_out, _ = decode_ref(q, kv, 0.125)
    with pytest.warns(UserWarning, match="no programmatic dependent launch"):
        out, _ = run_decode(q, kv, 0.125)
    assert asked == [(True, True), (False, True)]
    assert_close(out, ref_out, TOL[torch.float16], "after the refused PDL launch")
    asked.clear()
    run_decode(q, kv, 0.125, chain=False)
    assert asked == [(False, False)]
    monkeypatch.setattr(decode, "_PDL_REFUSED", set())
    run_decode(q, kv, 0.125, tuning=DecodeTuning(pdl=False))
    assert asked == [(False, False), (False, True)]


def test_decode_paged_equals_contiguous():
    kv = Paged([1000, 5, 333], 2, 64, 16, torch.float16)
    flat = kv.contiguous_copy()
    q = torch.randn(3, 8, 64, device=DEVICE).half()
    a, lse_a = run_decode(q, kv, 0.125)
    b, lse_b = run_decode(q, flat, 0.125)
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)  # same order of operations


def test_decode_fixed_split_size_is_batch_invariant():
    kv = Paged([700, 33, 1000], 2, 64, 16, torch.float16)
    q = torch.randn(3, 8, 64, device=DEVICE).half()
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.125, max_seq_len=1024,
                     out=out, split_size=128)  # fmt: skip
    alone = torch.full_like(q[:1], float("nan"))
    decode_attention(q[:1], kv.k, kv.v, kv.seq_lens[:1], kv.block_tables[:1], 0.125,
                     max_seq_len=2048, out=alone, split_size=128)  # fmt: skip
    assert torch.equal(out[:1], alone)


def test_decode_strided_out_and_empty_sequences():
    """``out`` a view into a wider buffer (untouched outside); a seq_len of 0 gives zeros."""
    lens = [40, 0, 300]
    kv = Paged([max(n, 1) for n in lens], 2, 64, 16, torch.float16)
    kv.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 64, device=DEVICE).half()
    buf = torch.full((3, 6, 64), float("nan"), device=DEVICE).half()
    out = buf[:, 1:5]  # batch stride 6 * 64
    for splits in (1, 5):
        decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.125, max_seq_len=300,
                         out=out, num_splits=splits)  # fmt: skip
        assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[:, 5]).all()
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        live = [0, 2]
        ref = reference.decode_attention(
            q[live].double(), kv.k.double(), kv.v.double(), kv.seq_lens[live],
            kv.block_tables[live], 0.125,
        )  # fmt: skip
        assert_close(out[live], ref, TOL[torch.float16], f"decode out, {splits} splits")


def test_decode_merge_matches_reference_and_leaves_counters_zero():
    """The merge in the last stage-1 program of each (sequence, KV head); every launch leaves
    the split counters zeroed for the next (CUDA graphs)."""
    from kernels import decode

    kv = Paged([700, 1, 129, 300], 2, 64, 16, torch.float16)
    q = torch.randn(4, 6, 64, device=DEVICE).half()
    ref_out, ref_lse = decode_ref(q, kv, 0.125)
    for splits in (3, 11):
        out, lse = run_decode(q, kv, 0.125, num_splits=splits)
        assert_close(out, ref_out, TOL[torch.float16], f"merged out, S={splits}")
        assert_close(lse, ref_lse, LSE_TOL[torch.float16], f"merged lse, S={splits}")
    counters = decode._COUNTERS[q.device]
    assert not counters.any(), f"split counters left at {counters.nonzero().flatten().tolist()}"


# ---------------------------------------------------------------- prefill

PREFILL_CASES = [  # (dtype, hq, hkv, d, qlens, ctx, page)
    (torch.float16, 2, 2, 64, [1, 17, 1000], [0, 0, 0], 16),
    (torch.float32, 3, 1, 64, [17, 130, 1], [5, 0, 40], 16),
    (torch.float16, 4, 1, 128, [200, 1, 65], [300, 0, 63], 128),
    (torch.float16, 8, 1, 64, [150, 33], [0, 77], 32),
    (torch.float32, 4, 4, 128, [70, 2], [129, 1000], 16),
    (torch.float16, 2, 1, 96, [100, 3], [20, 50], 16),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,qlens,ctx,page", PREFILL_CASES)
def test_prefill_matches_reference(dtype, hq, hkv, d, qlens, ctx, page):
    kv = Paged([n + c for n, c in zip(qlens, ctx)], hkv, d, page, dtype)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    scale = d**-0.5
    out, lse = run_prefill(q, kv, cu, scale)
    ref_out, ref_lse = prefill_ref(q, kv, cu, scale)
    assert_close(out, ref_out, TOL[dtype], "prefill out")
    assert_close(lse, ref_lse, LSE_TOL[dtype], "prefill lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_chunks_equal_whole_prompt(dtype):
    """Chunked prefill (each chunk attending to the cached context) == the prompt at once."""
    n, hq, hkv, d = 300, 4, 2, 64
    kv = Paged([n], hkv, d, 16, dtype)
    q = torch.randn(n, hq, d, device=DEVICE).to(dtype)
    whole, whole_lse = run_prefill(q, kv, cu_of([n]), 0.125)
    parts, lses = [], []
    bounds = [0, 100, 217, 218, 300]
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = Paged.__new__(Paged)
        chunk.k, chunk.v, chunk.block_tables, chunk.page = kv.k, kv.v, kv.block_tables, 16
        chunk.lens = [b]
        chunk.seq_lens = torch.tensor([b], dtype=torch.int32, device=DEVICE)
        o, lse = run_prefill(q[a:b], chunk, cu_of([b - a]), 0.125)
        parts.append(o)
        lses.append(lse)
    assert_close(torch.cat(parts), whole.double(), TOL[dtype], "chunked vs whole out")
    assert_close(torch.cat(lses), whole_lse.double(), LSE_TOL[dtype], "chunked vs whole lse")
    ref_out, _ = prefill_ref(q, kv, cu_of([n]), 0.125)
    assert_close(whole, ref_out, TOL[dtype], "whole prompt out")


def test_prefill_paged_equals_contiguous_and_strided_out():
    kv = Paged([400, 90], 2, 64, 16, torch.float16)
    flat = kv.contiguous_copy()
    cu = cu_of([150, 90])
    q = torch.randn(240, 4, 64, device=DEVICE).half()
    a, lse_a = run_prefill(q, kv, cu, 0.125)
    b, lse_b = run_prefill(q, flat, cu, 0.125)
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
    buf = torch.full((240, 7, 64), float("nan"), device=DEVICE).half()
    prefill_attention(q, kv.k, kv.v, cu, kv.seq_lens, kv.block_tables, 0.125, out=buf[:, 2:6])
    assert torch.equal(buf[:, 2:6], a) and torch.isnan(buf[:, :2]).all()
    assert torch.isnan(buf[:, 6:]).all()
