"""Triton kernels against the plain-torch reference (kernels/reference.py) on float64 copies.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets
where there is no GPU) on CPU tensors, at small sizes, with fp16 and fp32 operands only: the
interpreter miscomputes tl.dot on bf16 operands. With a GPU the same tests run on it. Every
output is poisoned with NaN before the kernel runs, so unwritten elements fail the check.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import assert_close, cu_of, head_major_copy, rel_err  # noqa: E402

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


def decode_ref(q, kv: Paged, scale, **kw):
    return reference.decode_attention(
        q.double(), kv.k.double(), kv.v.double(), kv.seq_lens, kv.block_tables, scale,
        return_lse=True, **kw,
    )  # fmt: skip


def prefill_ref(q, kv: Paged, cu, scale, **kw):
    return reference.prefill_attention(
        q.double(), kv.k.double(), kv.v.double(), cu, kv.seq_lens, kv.block_tables, scale,
        return_lse=True, **kw,
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
    DecodeTuning(min_split_tokens=64),
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


def test_decode_plan_takes_a_stage_fewer_for_short_splits_only():
    """The heuristic's plans run decode_config's tiles, and short_split_tiles where the plan's
    splits are longer than short_split_tokens[0] and at most [1] tokens (B=1, 2 KV heads,
    head dim 64: 132 SMs give 132 splits); fp8 and wide tiles, explicit tiles, and
    short_split_tiles None are never changed."""
    from kernels.decode import decode_config, num_splits_for, plan_splits

    base, short = decode_config(64), DecodeTuning().short_split_tiles
    assert short is not None and short != base
    for max_len, sms, want in (
        (4096, 132, base),  # 128-token splits: the lower bound is excluded
        (16384, 132, base),
        (17000, 132, short),  # 192
        (65536, 132, short),  # 512
        (131072, 132, short),  # 1,024: the upper bound is included
        (140000, 132, base),  # 1,152
        (65536, 1, base),  # one split
    ):
        plan = plan_splits(1, 2, 64, 2, max_len, sms)
        assert plan.splits == num_splits_for(1, 2, max_len, sms, base[0], 2), (max_len, sms)
        assert plan.tiles == want, (max_len, sms, plan)
    assert plan_splits(1, 2, 64, 2, 4096, 132, num_splits=8).tiles == short  # 512 tokens
    assert plan_splits(1, 2, 64, 2, 4096, 132, split_size=2048).tiles == base
    assert plan_splits(1, 2, 64, 2, 4096, 132, split_size=256).tiles == short
    for tuning in (DecodeTuning(tiles=(32, 4, 2)), DecodeTuning(short_split_tiles=None),
                   DecodeTuning(short_split_tokens=(1024, 2048))):  # fmt: skip
        assert plan_splits(1, 2, 64, 2, 65536, 132, tuning).tiles == (tuning.tiles or base)
    assert plan_splits(1, 2, 64, 1, 65536, 132, fp8=True).tiles == DecodeTuning().fp8_tiles
    assert plan_splits(1, 2, 256, 2, 65536, 132).tiles == DecodeTuning().wide_tiles
    with pytest.raises(ValueError, match="short_split_tokens"):
        DecodeTuning(short_split_tokens=(512, 256))
    with pytest.raises(ValueError, match="short_split_tiles"):
        DecodeTuning(short_split_tiles=(48, 4, 3))


def test_decode_plan_takes_few_rows_tiles_where_the_rows_fit_the_sms():
    """few_rows_tiles replace decode_config's 16-bit tiles (and short_split_tiles) where batch x
    KV heads is at most the SM count, and the splits follow their one program an SM; more rows,
    split_size mode, explicit tiles, fp8 and wide tiles keep their own. The H200 sets them
    (decode_tuning_for), other GPUs keep DEFAULT_DECODE_TUNING's plan."""
    from kernels.decode import (
        DEFAULT_DECODE_TUNING,
        decode_tuning_for,
        num_splits_for,
        plan_splits,
    )

    few = (128, 4, 3)
    tuning = DecodeTuning(few_rows_tiles=few)
    for batch, hkv, ctx in ((1, 4, 32800), (1, 8, 131166), (16, 8, 4096), (33, 4, 65536)):
        plan = plan_splits(batch, hkv, 128, 2, ctx, 132, tuning)
        assert plan.tiles == few, (batch, hkv, plan)
        assert plan.splits == num_splits_for(batch, hkv, ctx, 132, 128, 1), (batch, hkv, plan)
    assert plan_splits(1, 4, 128, 2, 32800, 132, tuning).splits == 33  # 132 programs
    for batch, hkv in ((32, 8), (34, 4)):  # 256 / 136 rows: DEFAULT_DECODE_TUNING's plan
        assert plan_splits(batch, hkv, 128, 2, 4096, 132, tuning) == plan_splits(
            batch, hkv, 128, 2, 4096, 132
        )
    for kw in ({"split_size": 512}, {}):
        other = DecodeTuning(few_rows_tiles=few, tiles=(32, 4, 2)) if not kw else tuning
        assert plan_splits(1, 4, 128, 2, 32768, 132, other, **kw).tiles != few, kw
    assert plan_splits(1, 4, 128, 1, 32768, 132, tuning, fp8=True).tiles == tuning.fp8_tiles
    assert plan_splits(1, 4, 256, 2, 32768, 132, tuning).tiles == tuning.wide_tiles
    assert plan_splits(1, 4, 128, 2, 32768, 132, tuning, num_splits=8) == (8, 128, few)
    assert plan_splits(1, 4, 128, 4, 32768, 132, tuning).tiles == (64, 4, 3)  # float32: fit_smem
    assert decode_tuning_for("NVIDIA H200").few_rows_tiles == few
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", ""):
        assert decode_tuning_for(name) is DEFAULT_DECODE_TUNING, name
    with pytest.raises(ValueError, match="few_rows_tiles"):
        DecodeTuning(few_rows_tiles=(96, 4, 3))


def test_decode_few_rows_tiles_match_the_reference():
    """Two sequences of 2 KV heads (4 rows, the interpreter's 4 SMs) on few_rows_tiles, with
    the heuristic's splits (two) and with 3, merged, against the reference."""
    lens = [700, 1000]
    kv = Paged(lens, 2, 64, 16, torch.float16)
    q = torch.randn(len(lens), 8, 64, device=DEVICE).half()
    ref_out, ref_lse = decode_ref(q, kv, 0.125)
    tuning = DecodeTuning(few_rows_tiles=(128, 4, 3))
    for splits in (None, 3):
        out, lse = decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.125,
                                    max_seq_len=1024, return_lse=True, num_splits=splits,
                                    tuning=tuning)  # fmt: skip
        assert_close(out, ref_out, TOL[torch.float16], f"few rows, {splits} splits")
        assert_close(lse, ref_lse, LSE_TOL[torch.float16], f"few rows lse, {splits} splits")


def test_decode_tiles_fit_shared_memory():
    """The measured tiles are for 2-byte caches: a float32 cache at head dim 256 takes narrower
    tiles that fit sm_90's 227 KB (the H100 refused (64, 4, 3) there: 282,688 bytes), the rest
    keep theirs; explicit tiles are never changed."""
    from kernels.decode import _SMEM_PER_BLOCK, _smem_bytes, decode_config, plan_splits

    for d, itemsize in ((64, 2), (128, 2), (128, 4), (256, 2), (256, 4)):
        tiles = plan_splits(1, 8, d, itemsize, 4096, 132, DecodeTuning(tiles=None)).tiles
        block_n, _, stages = tiles
        assert _smem_bytes(block_n, stages, d, itemsize) <= _SMEM_PER_BLOCK, (d, itemsize)
        want = decode_config(d)[0] if (d, itemsize) != (256, 4) else 32
        assert block_n == want, (d, itemsize, tiles)
    wide = DecodeTuning().wide_tiles
    assert plan_splits(1, 8, 256, 4, 4096, 132, DecodeTuning(tiles=wide)).tiles == wide


def test_decode_tuning_sizes_the_splits():
    """Each split-sizing field moves the plan as documented (B=1, 2 KV heads, 132 SMs, head
    dim 64, fp16)."""
    from kernels.decode import plan_splits

    def plan(max_len, **fields):
        return plan_splits(1, 2, 64, 2, max_len, 132, DecodeTuning(**fields))

    default = plan(65536)
    assert default.splits == 128 and default.min_split == 128  # 2 per SM x 132 / 2 heads
    assert plan(65536, programs_per_sm=1).splits == 64
    assert plan(65536, max_splits=16).splits == 16
    assert plan(4096).splits == 32  # 4K / 128-token splits
    assert plan(4096, min_split_tokens=512).splits == 8
    assert plan(4096, min_split_tokens=512).min_split == 512
    assert plan(4096, min_split_tokens=100).min_split == 128  # whole tiles of 64


@pytest.mark.parametrize(
    "fields, message",
    [({"tiles": (48, 4, 3)}, "tiles"), ({"tiles": (8, 4, 3)}, "tiles"),
     ({"tiles": (64, 3, 3)}, "tiles"), ({"tiles": (64, 4, 0)}, "tiles"),
     ({"tiles": (64, 4)}, "tiles"), ({"programs_per_sm": 0}, "programs_per_sm"),
     ({"min_split_tokens": 0}, "min_split_tokens"), ({"max_splits": 0}, "max_splits"),
     ({"prefetch_tokens": -1}, "prefetch_tokens"),
     ({"wide_prefetch_tokens": -64}, "wide_prefetch_tokens"),
     ({"fp8_prefetch_tokens": -1}, "fp8_prefetch_tokens")],
)  # fmt: skip
def test_decode_tuning_rejects_what_the_kernel_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodeTuning(**fields)


def test_decode_prefetch_follows_the_cache():
    """``prefetch_for``: head dims over 128 take the wide value (an fp8 cache too, as the
    tiles do), an fp8 cache read with f16 dots the fp8 one, the rest the 16-bit one; by
    default none for 16-bit caches up to head dim 128 (measured: DecodeTuning)."""
    t = DecodeTuning(prefetch_tokens=1, wide_prefetch_tokens=2, fp8_prefetch_tokens=3)
    assert [
        t.prefetch_for(d, f16)
        for d, f16 in [(128, False), (64, False), (256, False), (256, True), (128, True)]
    ] == [1, 1, 2, 2, 3]
    default = DecodeTuning()
    assert default.prefetch_for(128, False) == 0
    assert default.prefetch_for(256, False) > 0 and default.prefetch_for(128, True) > 0


@pytest.mark.parametrize("d, fp8, want", [(128, False, 5), (256, False, 6), (128, True, 7)])
def test_decode_launch_takes_the_caches_prefetch(monkeypatch, d, fp8, want):
    """``decode_attention`` launches with ``prefetch_for``'s value for its cache."""
    import kernels.decode as decode
    from kernels.kv_quant import FP8_KV_DTYPE, kv_scale_shape

    seen = []
    monkeypatch.setattr(decode, "_launch", lambda *a, prefetch, pdl, **kw: seen.append(prefetch))
    k = torch.randn(2, 16, 2, d, device=DEVICE)
    scales = {}
    if fp8:
        k = k.to(FP8_KV_DTYPE)
        sc = torch.ones(kv_scale_shape(2, 16, 2), device=DEVICE, dtype=torch.bfloat16)
        scales = dict(k_scale=sc, v_scale=sc)
    q = torch.randn(1, 4, d, device=DEVICE).half()
    tuning = DecodeTuning(prefetch_tokens=5, wide_prefetch_tokens=6, fp8_prefetch_tokens=7)
    decode_attention(q, k if fp8 else k.half(), k if fp8 else k.half(),
                     torch.tensor([20], dtype=torch.int32, device=DEVICE),
                     torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE), 0.1,
                     tuning=tuning, **scales)  # fmt: skip
    assert seen == [want]


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

    def launch(*args, pdl, **kwargs):
        chain = args[-1]
        asked.append((pdl, chain))
        if pdl:
            raise RuntimeError("launch_pdl: unexpected keyword")
        real(*args, pdl=False, **kwargs)

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


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("dtype,hq,hkv,d,qlens,ctx,page", [
    (torch.float16, 4, 2, 64, [5, 70, 1], [900, 300, 0], 16),  # a part with no keys: ctx 0
    (torch.float32, 4, 1, 64, [33, 2], [517, 1000], 32),
    (torch.float16, 2, 2, 128, [64], [1500], 64),
])  # fmt: skip
def test_prefill_kv_splits_match_the_reference(dtype, hq, hkv, d, qlens, ctx, page, splits):
    """Each query tile's keys in parts, merged by their LSEs: the same attention as one pass,
    parts without keys (short contexts, more parts than tiles) included."""
    kv = Paged([n + c for n, c in zip(qlens, ctx)], hkv, d, page, dtype)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    out, lse = run_prefill(q, kv, cu, d**-0.5, kv_splits=splits)
    ref_out, ref_lse = prefill_ref(q, kv, cu, d**-0.5)
    assert_close(out, ref_out, TOL[dtype], f"prefill out, {splits} parts")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"prefill lse, {splits} parts")
    plain = prefill_attention(q, kv.k, kv.v, cu, kv.seq_lens, kv.block_tables, d**-0.5,
                              max_query_len=max(qlens), kv_splits=splits)  # fmt: skip
    assert_close(plain, ref_out, TOL[dtype], "prefill out without the lse")


@pytest.mark.parametrize("kw", [{"kv_splits": 0}, {"kv_splits": 2, "window": 64},
                                {"kv_splits": 2, "path": "hopper"}])  # fmt: skip
def test_prefill_kv_splits_refused_where_they_cannot_run(kw):
    kv = Paged([100], 2, 64, 16, torch.float16)
    q = torch.randn(10, 2, 64, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match="kv_splits"):
        prefill_attention(q, kv.k, kv.v, cu_of([10]), kv.seq_lens, kv.block_tables, 0.125, **kw)


def test_prefill_kv_splits_fill_the_sms_only_where_the_programs_leave_them_idle():
    from kernels.prefill import prefill_kv_splits

    assert prefill_kv_splits(32, 120064, 128, 132) == 4  # a 128-token chunk of 32 heads
    assert prefill_kv_splits(66, 120064, 128, 132) == 2
    assert prefill_kv_splits(67, 120064, 128, 132) == 1  # over half the SMs busy: no cut
    assert prefill_kv_splits(512, 120064, 128, 132) == 1
    assert prefill_kv_splits(8, 4096, 128, 132) == 4  # short context: parts of >= 8 tiles
    assert prefill_kv_splits(32, 512, 128, 132) == 1


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


# ---------------------------------------------------------------- prefill, the Hopper path
# Forced (path="hopper"): in the interpreter, bulk tensor copies through tensor descriptors and
# the persistent loop run as plain Python; bf16 and the sm_90 compile are tests_kernels_gpu's.
# Tiles of 32 queries over 4 persistent programs (the interpreter's num_sms) give many waves.

HOPPER_CASES = [  # (dtype, hq, hkv, d, qlens, ctx, page, config)
    (torch.float16, 4, 1, 64, [1, 17, 150], [0, 70, 30], 64, (32, 32, 4, 1, 1)),
    (torch.float16, 8, 2, 128, [100, 33], [200, 0], 128, (32, 64, 4, 1, 1)),
    (torch.float32, 4, 2, 64, [70, 2, 129], [129, 300, 0], 64, (32, 64, 4, 1, 1)),
    (torch.float16, 4, 4, 64, [64, 1, 90], [64, 1, 0], 64, (32, 32, 4, 1, 0)),  # no loop
    (torch.float16, 2, 1, 256, [40, 3], [20, 61], 64, (16, 32, 4, 1, 2)),  # 8 programs
]


@pytest.mark.parametrize("dtype,hq,hkv,d,qlens,ctx,page,config", HOPPER_CASES)
def test_prefill_hopper_matches_reference(dtype, hq, hkv, d, qlens, ctx, page, config):
    """GQA, several sequences, chunks after cached context (lengths ending inside a page,
    on a tile edge, one token), the LSE; persistent and not."""
    kv = Paged([n + c for n, c in zip(qlens, ctx)], hkv, d, page, dtype)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    out, lse = run_prefill(q, kv, cu, d**-0.5, path="hopper", config=config)
    ref_out, ref_lse = prefill_ref(q, kv, cu, d**-0.5)
    assert_close(out, ref_out, TOL[dtype], f"hopper prefill out {config}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"hopper prefill lse {config}")


def nan_past_the_end(kv: Paged) -> Paged:
    """``kv`` with every slot past each sequence's end NaN (a freed sequence's leftovers, or
    never written): the Hopper path's copies bring them in with the diagonal tiles."""
    bad = Paged.__new__(Paged)
    bad.__dict__.update(kv.__dict__)
    bad.k, bad.v = kv.k.clone(), kv.v.clone()
    for b, n in enumerate(kv.lens):
        page, off = divmod(n, kv.page)
        if off:
            last = kv.block_tables[b, page].long()
            bad.k[last, off:], bad.v[last, off:] = float("nan"), float("nan")
    return bad


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_hopper_chunks_and_dead_slots(dtype):
    """Chunked prefill on the Hopper path equals the whole prompt and the reference, with
    every slot past the end of the sequence so far NaN."""
    n, hq, hkv, d, page = 300, 4, 2, 64, 64
    kv = Paged([n], hkv, d, page, dtype)
    q = torch.randn(n, hq, d, device=DEVICE).to(dtype)
    cfg = (32, 64, 4, 1, 1)
    whole, whole_lse = run_prefill(q, nan_past_the_end(kv), cu_of([n]), 0.125, path="hopper",
                                   config=cfg)  # fmt: skip
    parts, lses = [], []
    for a, b in ((0, 100), (100, 217), (217, 218), (218, n)):
        chunk = Paged.__new__(Paged)
        chunk.__dict__.update(kv.__dict__)
        chunk.lens, chunk.seq_lens = [b], torch.tensor([b], dtype=torch.int32, device=DEVICE)
        chunk = nan_past_the_end(chunk)
        o, lse = run_prefill(q[a:b], chunk, cu_of([b - a]), 0.125, path="hopper", config=cfg)
        parts.append(o)
        lses.append(lse)
    ref_out, ref_lse = prefill_ref(q, kv, cu_of([n]), 0.125)
    assert_close(whole, ref_out, TOL[dtype], "hopper whole prompt out")
    assert_close(whole_lse, ref_lse, LSE_TOL[dtype], "hopper whole prompt lse")
    assert_close(torch.cat(parts), ref_out, TOL[dtype], "hopper chunked out")
    assert_close(torch.cat(lses), ref_lse, LSE_TOL[dtype], "hopper chunked lse")


@pytest.mark.parametrize("window,softcap", [(0, 20.0), (75, 0.0), (75, 30.0)])
def test_prefill_hopper_window_softcap(window, softcap):
    """Windows and soft-capping share the portable code: right, and no page left of a window
    is read (those pages and the tokens left of the window in its first page are NaN)."""
    qlens, ctx = [40, 100, 1], [300, 20, 200]
    kv = Paged([a + b for a, b in zip(qlens, ctx)], 2, 64, 64, torch.float16)
    bad = poison_left_of(kv, [max(0, c - window + 1) for c in ctx]) if window else kv
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), 4, 64, device=DEVICE).half()
    ref_out, ref_lse = prefill_ref(q, kv, cu, 0.125, window=window, softcap=softcap)
    out, lse = run_prefill(q, bad, cu, 0.125, window=window, softcap=softcap, path="hopper",
                           config=(32, 32, 4, 1, 1))  # fmt: skip
    assert_close(out, ref_out, TOL[torch.float16], f"hopper window {window} cap {softcap}")
    assert_close(lse, ref_lse, LSE_TOL[torch.float16], f"hopper lse {window} cap {softcap}")


@pytest.mark.parametrize(
    "d, page, kw, message",
    [(96, 64, {}, "head dim 96"), (64, 32, {"config": (32, 64, 4, 1)}, "page 32 < BLOCK_N 64"),
     (64, 64, {"path": "fast"}, "path must be")],
)  # fmt: skip
def test_prefill_hopper_refuses_what_it_cannot_run(d, page, kw, message):
    kv = Paged([50], 1, d, page, torch.float16)
    q = torch.randn(50, 2, d, device=DEVICE).half()
    with pytest.raises(ValueError, match=message):
        run_prefill(q, kv, cu_of([50]), 0.125, **{"path": "hopper", **kw})


def head_major_paged(kv: Paged) -> Paged:
    """``kv`` in pools that keep a head's rows of a page together, the same values; the engine
    stores fp8 pages so (tests/test_kv_fp8.py)."""
    other = Paged.__new__(Paged)
    other.__dict__.update(kv.__dict__)
    other.k, other.v = head_major_copy(kv.k), head_major_copy(kv.v)
    return other


@pytest.mark.parametrize("path", ["decode", "portable", "hopper"])
def test_head_major_pools_give_the_same_results(path):
    """fp16 pools of a head's rows: decode and both prefill paths (the Hopper path's bulk
    copies over the other pool view) give, bit for bit, what token rows of the same values
    give, and the reference's."""
    qlens, ctx = [40, 1, 90], [100, 127, 0]
    kv = nan_past_the_end(Paged([a + b for a, b in zip(qlens, ctx)], 2, 64, 64, torch.float16))
    if path == "decode":
        q = torch.randn(len(qlens), 8, 64, device=DEVICE).half()
        got = [run_decode(q, x, 0.125, num_splits=3) for x in (kv, head_major_paged(kv))]
        want = decode_ref(q, kv, 0.125)
    else:
        q = torch.randn(sum(qlens), 8, 64, device=DEVICE).half()
        cfg = (32, 32, 4, 1, 1) if path == "hopper" else None
        got = [run_prefill(q, x, cu_of(qlens), 0.125, path=path, config=cfg)
               for x in (kv, head_major_paged(kv))]  # fmt: skip
        want = prefill_ref(q, kv, cu_of(qlens), 0.125)
    (out, lse), (out_hm, lse_hm) = got
    assert torch.equal(out_hm, out) and torch.equal(lse_hm, lse), f"{path}: layouts differ"
    assert_close(out_hm, want[0], TOL[torch.float16], f"{path} head-major out")
    assert_close(lse_hm, want[1], LSE_TOL[torch.float16], f"{path} head-major lse")


def test_prefill_hopper_refuses_head_major_pools_it_cannot_view():
    """A head's rows with room between pages: no dense view for the bulk copies."""
    kv = Paged([50], 2, 64, 64, torch.float16)
    wide = torch.zeros(kv.k.shape[0], 3, 64, 64, device=DEVICE).half()
    kv.k, kv.v = wide[:, :2].transpose(1, 2), wide[:, 1:].transpose(1, 2)
    q = torch.randn(50, 4, 64, device=DEVICE).half()
    with pytest.raises(ValueError, match="dense"):
        run_prefill(q, kv, cu_of([50]), 0.125, path="hopper")


def test_prefill_hopper_takes_fp8_and_auto_takes_it_on_sm90_only():
    """An fp8 cache: path="hopper" runs it (its results: tests/test_kv_fp8.py); auto takes
    it on sm_90 at pages of >= 64 tokens (the same bits), the portable path elsewhere."""
    from kernels.kv_quant import FP8_KV_DTYPE, kv_scale_shape

    k = torch.randn(4, 64, 1, 64, device=DEVICE).to(FP8_KV_DTYPE)
    sc = torch.rand(kv_scale_shape(4, 64, 1), device=DEVICE).to(torch.bfloat16)
    q = torch.randn(100, 2, 64, device=DEVICE).half()
    args = (q, k, k, cu_of([100]), torch.tensor([150], dtype=torch.int32, device=DEVICE),
            torch.arange(4, dtype=torch.int32, device=DEVICE)[None], 0.125)  # fmt: skip
    out = {p: prefill_attention(*args, k_scale=sc, v_scale=sc, path=p)
           for p in ("hopper", "portable", "auto")}  # fmt: skip
    assert_close(out["hopper"], out["portable"], TOL[torch.float16], "fp8 hopper vs portable")
    on_sm90 = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert torch.equal(out["auto"], out["hopper" if on_sm90 else "portable"])


# ---------------------------------------------------------------- prefill, the Gluon kernel
# path="gluon" (kernels.prefill_gluon) runs on sm_90 only: Gluon has no interpreter in Triton
# 3.6 (a gluon.jit kernel ignores TRITON_INTERPRET and asks for a GPU driver). Here: what it
# refuses and why; its sm_90 compile is test_gluon_compile's, its results test_kernels_gpu's.


def test_prefill_gluon_refuses_what_it_cannot_run():
    from kernels.prefill_gluon import GluonConfig, gluon_config, gluon_refusal
    from kernels.prefill_paths import GLUON_TRITON

    k = torch.zeros(4, 128, 2, 128, dtype=torch.bfloat16)
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    cfg = gluon_config(128, q.dtype, 128)
    h100 = (9, 0)
    why = gluon_refusal(q, k, 0, 0.0, False, cfg, h100)
    if triton.__version__.startswith(GLUON_TRITON):
        assert why is None, why
    else:  # written in 3.6's Gluon API: refused last, after every other reason
        assert why and f"this Triton is {triton.__version__}" in why, why
    cases = [  # (q, k, window, softcap, fp8, cfg, capability), the reason's words
        ((q, k, 0, 0.0, False, cfg, None), "sm_90"),
        ((q, k, 0, 0.0, False, cfg, (10, 0)), "sm_100"),
        ((q, k, 0, 0.0, False, cfg, (8, 9)), "sm_89"),
        ((q, k, 4096, 0.0, False, cfg, h100), "sliding windows"),
        ((q, k, 0, 30.0, False, cfg, h100), "soft-capping"),
        ((q, k, 0, 0.0, True, cfg, h100), "fp8"),
        ((q.float(), k.float(), 0, 0.0, False, cfg, h100), "bf16 and fp16"),
        ((q[..., :96], k[..., :96], 0, 0.0, False, cfg, h100), "head dim 96"),
        ((q, k[:, :64], 0, 0.0, False, cfg, h100), "page 64 < block_n 128"),
        ((q, k, 0, 0.0, False, GluonConfig(128, 4), h100), "shared memory"),
    ]
    for args, words in cases:
        why = gluon_refusal(*args)
        assert why and words in why, (words, why)


def test_prefill_gluon_path_raises_with_the_reason():
    """Through prefill_attention: a ValueError naming the reason (here, on the CPU or a GPU
    that is not sm_90, or the window), never a quiet fall-back; configs of the other kind."""
    from kernels.prefill_gluon import GluonConfig

    kv = Paged([50], 1, 64, 64, torch.float16)
    q = torch.randn(50, 2, 64, device=DEVICE).half()
    on_sm90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    for kw, message in [
        ({"window": 16}, "Gluon path cannot run this: sliding windows" if on_sm90 else "sm_"),
        ({"config": (32, 32, 4, 1)}, "takes a GluonConfig"),
    ]:
        with pytest.raises(ValueError, match=message):
            run_prefill(q, kv, cu_of([50]), 0.125, path="gluon", **kw)
    small = Paged([50], 1, 64, 8, torch.float16)  # 8-token pages: no KV tile fits
    with pytest.raises(ValueError, match="Gluon path cannot run this: page 8 < 16"):
        run_prefill(q, small, cu_of([50]), 0.125, path="gluon")
    with pytest.raises(ValueError, match='for path="gluon"'):
        run_prefill(q, kv, cu_of([50]), 0.125, path="hopper", config=GluonConfig(64, 2))


def test_gluon_config_checks_and_defaults():
    from kernels.prefill_gluon import SMEM, SMEM_SPARE, GluonConfig, gluon_config

    for bad in [dict(block_n=48), dict(stages=1), dict(consumer_regs=244),
                dict(consumer_regs=248, producer_regs=24)]:  # fmt: skip
        with pytest.raises(ValueError, match="GluonConfig"):
            GluonConfig(**bad)
    for d, page, want in [(128, 128, (128, 3)), (128, 64, (64, 4)), (64, 64, (64, 4)),
                          (256, 64, (64, 2)), (256, 256, (64, 2))]:  # fmt: skip
        cfg = gluon_config(d, torch.bfloat16, page)
        assert (cfg.block_n, cfg.stages) == want, (d, page, cfg)
        assert cfg.smem_bytes(d) <= SMEM - SMEM_SPARE


# ---------------------------------------------------------------- sliding windows, soft-capping
# Windows against the reference's explicit math in float64 (a query at p sees keys
# p - window < j <= p; soft-capped scores softcap * tanh(s / softcap)).

WINDOW_LENS = [1, 17, 64, 100, 257, 301, 700]  # shorter than, equal to, longer than windows
WINDOW_DECODE_CASES = [  # (dtype, hq, hkv, d, page, window)
    (torch.float16, 8, 2, 64, 16, 1),
    (torch.float16, 8, 2, 64, 16, 100),  # neither a page nor a tile multiple; = a context
    (torch.float32, 4, 1, 64, 64, 64),  # one tile, one page
    (torch.float16, 6, 2, 96, 16, 257),
    (torch.float16, 4, 4, 64, 128, 300),  # pages longer than the tile
    (torch.float16, 8, 2, 64, 32, 70),  # (16-token tiles below: pages of 2 tiles)
    (torch.float32, 8, 2, 128, 32, 700),  # = the longest context
    (torch.float16, 8, 2, 64, 16, 5000),  # longer than every context
]


@pytest.mark.parametrize("dtype,hq,hkv,d,page,window", WINDOW_DECODE_CASES)
def test_decode_window_matches_reference(dtype, hq, hkv, d, page, window):
    kv = Paged(WINDOW_LENS, hkv, d, page, dtype)
    q = torch.randn(len(WINDOW_LENS), hq, d, device=DEVICE).to(dtype)
    ref_out, ref_lse = decode_ref(q, kv, d**-0.5, window=window)
    for kw in ({}, {"num_splits": 1}, {"split_size": 128},
               {"num_splits": 3, "tuning": DecodeTuning(tiles=(16, 4, 2))}):  # fmt: skip
        out, lse = run_decode(q, kv, d**-0.5, window=window, **kw)
        assert_close(out, ref_out, TOL[dtype], f"decode window {window} {kw}")
        assert_close(lse, ref_lse, LSE_TOL[dtype], f"decode lse window {window} {kw}")
    # a graph's grid: planned for a longer max_seq_len than any row has
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, d**-0.5, max_seq_len=8192,
                     out=out, window=window)  # fmt: skip
    assert_close(out, ref_out, TOL[dtype], f"decode window {window}, max_seq_len 8192")


def test_decode_window_changes_the_result():
    """The window cases above can fail: the windowed reference is not the global one."""
    kv = Paged([300, 1000], 2, 64, 16, torch.float16)
    q = torch.randn(2, 8, 64, device=DEVICE).half()
    windowed, _ = decode_ref(q, kv, 0.125, window=100)
    full, _ = decode_ref(q, kv, 0.125)
    assert rel_err(windowed, full) > 0.1
    out, _ = run_decode(q, kv, 0.125)  # and window=0 is the global kernel
    assert_close(out, full, TOL[torch.float16], "window 0")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("window", [0, 90])
@pytest.mark.parametrize("gain", [4.0, 300.0])  # capped moderately; scores far past the cap
def test_decode_softcap_matches_reference(dtype, window, gain):
    lens = [1, 200, 1000, 33]
    kv = Paged(lens, 2, 64, 16, dtype)
    q = (torch.randn(len(lens), 8, 64, device=DEVICE) * gain).to(dtype)
    ref_out, ref_lse = decode_ref(q, kv, 0.125, window=window, softcap=5.0)
    uncapped, _ = decode_ref(q, kv, 0.125, window=window)
    assert rel_err(ref_out, uncapped) > 0.05  # the cap bites: this test can fail
    for kw in ({}, {"num_splits": 1}, {"split_size": 128}):
        out, lse = run_decode(q, kv, 0.125, window=window, softcap=5.0, **kw)
        assert_close(out, ref_out, TOL[dtype], f"softcap, window {window}, x{gain} {kw}")
        assert_close(lse, ref_lse, LSE_TOL[dtype], f"softcap lse, window {window} {kw}")


def test_decode_window_fixed_split_size_is_batch_invariant():
    """split_size mode with a window: a row gives the same bits alone or in a batch, whatever
    the grid (every split ``split_size`` long from the window's first tile)."""
    kv = Paged([700, 33, 1000, 130], 2, 64, 16, torch.float16)
    q = torch.randn(4, 8, 64, device=DEVICE).half()
    batch = decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.125,
                             max_seq_len=1024, split_size=64, window=200)  # fmt: skip
    for b in range(4):
        alone = decode_attention(q[b : b + 1], kv.k, kv.v, kv.seq_lens[b : b + 1],
                                 kv.block_tables[b : b + 1], 0.125, max_seq_len=4096,
                                 split_size=64, window=200)  # fmt: skip
        assert torch.equal(batch[b : b + 1], alone), b


def test_decode_plan_follows_the_window():
    """The grid is sized by the tokens a row can read: a 4,096-token window at 128K gets the
    plan of a 4K context; split_size mode counts the window's first, partial tile too."""
    from kernels.decode import plan_splits

    # (B=1 has its 32 splits (head dim 256: 16) from 4K (1K) up: the window that changes its
    # plan is shorter)
    for batch, hkv, d, w in ((1, 8, 128, 2048), (8, 8, 128, 256), (1, 8, 256, 512),
                             (32, 4, 64, 128)):  # fmt: skip
        at_w = plan_splits(batch, hkv, d, 2, w, 132)
        assert plan_splits(batch, hkv, d, 2, 131072, 132, window=w) == at_w
        assert plan_splits(batch, hkv, d, 2, 131072, 132) != at_w
        huge = plan_splits(batch, hkv, d, 2, 131072, 132, window=1 << 20)
        assert huge == plan_splits(batch, hkv, d, 2, 131072, 132)
    fixed = plan_splits(1, 8, 128, 2, 131072, 132, split_size=512, window=4096)
    assert fixed.splits == 9 and fixed.min_split == 512  # ceil((4096 + 63) / 512)
    assert plan_splits(1, 8, 128, 2, 1000, 132, split_size=512, window=4096).splits == 2


def test_decode_wide_tiles_are_the_tuning_for_head_dim_256():
    from kernels.decode import decode_config, plan_splits

    assert decode_config(256) == DecodeTuning().wide_tiles
    assert decode_config(128) == decode_config(128, DecodeTuning(wide_tiles=(16, 4, 2)))
    tuning = DecodeTuning(wide_tiles=(16, 4, 3))
    assert plan_splits(1, 2, 256, 2, 65536, 132, tuning).tiles == (16, 4, 3)
    assert plan_splits(1, 2, 128, 2, 4096, 132, tuning).tiles == decode_config(128)
    with pytest.raises(ValueError, match="wide_tiles"):
        DecodeTuning(wide_tiles=(24, 4, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (45, 0.0), (70, 20.0)])
def test_head_dim_256_decode_and_prefill(dtype, window, softcap):
    """Gemma's head dim (2 query heads per KV head), with and without a window and a cap."""
    d, hq, hkv = 256, 4, 2
    scale = d**-0.5 * 2  # sharper scores, so that a soft-cap of 20 changes them
    kv = Paged([1, 40, 130, 300], hkv, d, 16, dtype)
    q = torch.randn(4, hq, d, device=DEVICE).to(dtype)
    ref_out, ref_lse = decode_ref(q, kv, scale, window=window, softcap=softcap)
    for kw in ({}, {"num_splits": 3}, {"tuning": DecodeTuning(wide_tiles=(16, 4, 2))}):
        out, lse = run_decode(q, kv, scale, window=window, softcap=softcap, **kw)
        assert_close(out, ref_out, TOL[dtype], f"decode d=256 {kw}")
        assert_close(lse, ref_lse, LSE_TOL[dtype], f"decode lse d=256 {kw}")
    qlens, ctx = [1, 40, 70], [0, 30, 100]
    kv = Paged([a + b for a, b in zip(qlens, ctx)], hkv, d, 16, dtype)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    ref_out, ref_lse = prefill_ref(q, kv, cu, scale, window=window, softcap=softcap)
    out, lse = run_prefill(q, kv, cu, scale, window=window, softcap=softcap,
                           config=(32, 16, 4, 1))  # fmt: skip
    assert_close(out, ref_out, TOL[dtype], "prefill d=256")
    assert_close(lse, ref_lse, LSE_TOL[dtype], "prefill lse d=256")


WINDOW_PREFILL_CASES = [  # (dtype, hq, hkv, d, page, window, config)
    (torch.float16, 4, 2, 64, 16, 1, (32, 16, 4, 1)),
    (torch.float16, 4, 2, 64, 16, 20, (32, 16, 4, 1)),  # window < BLOCK_M
    (torch.float32, 3, 1, 64, 64, 50, None),  # (32, 32) tiles, pages of 2 tiles
    (torch.float16, 2, 2, 64, 16, 100, (16, 32, 4, 1)),  # pages shorter than the tile
    (torch.float16, 4, 1, 128, 128, 130, None),  # (128, 64) tiles
    (torch.float32, 4, 4, 64, 16, 400, (32, 16, 4, 1)),  # longer than some contexts
    (torch.float16, 2, 1, 96, 32, 1000, None),  # longer than every context
]


@pytest.mark.parametrize("dtype,hq,hkv,d,page,window,config", WINDOW_PREFILL_CASES)
def test_prefill_window_matches_reference(dtype, hq, hkv, d, page, window, config):
    """Chunks at the start of a sequence and over cached context, crossing the window's edge
    (a chunk's first query sees back past the chunk, its last does not)."""
    qlens, ctx = [1, 17, 150, 64, 3], [0, 100, 60, 300, 250]
    kv = Paged([a + b for a, b in zip(qlens, ctx)], hkv, d, page, dtype)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    ref_out, ref_lse = prefill_ref(q, kv, cu, d**-0.5, window=window)
    out, lse = run_prefill(q, kv, cu, d**-0.5, window=window, config=config)
    assert_close(out, ref_out, TOL[dtype], f"prefill window {window}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"prefill lse window {window}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("window", [0, 60])
def test_prefill_softcap_matches_reference(dtype, window):
    qlens, ctx = [1, 90, 33], [0, 40, 200]
    kv = Paged([a + b for a, b in zip(qlens, ctx)], 2, 64, 16, dtype)
    cu = cu_of(qlens)
    q = (torch.randn(sum(qlens), 4, 64, device=DEVICE) * 4).to(dtype)
    ref_out, ref_lse = prefill_ref(q, kv, cu, 0.125, window=window, softcap=5.0)
    assert rel_err(ref_out, prefill_ref(q, kv, cu, 0.125, window=window)[0]) > 0.05
    out, lse = run_prefill(q, kv, cu, 0.125, window=window, softcap=5.0, config=(32, 16, 4, 1))
    assert_close(out, ref_out, TOL[dtype], f"prefill softcap window {window}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"prefill softcap lse window {window}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_window_chunks_equal_whole_prompt(dtype):
    """Chunked prefill with a window of 70: chunks that start before, at and past the window's
    edge, one of a single token, give the whole prompt's output."""
    n, window = 300, 70
    kv = Paged([n], 2, 64, 16, dtype)
    q = torch.randn(n, 4, 64, device=DEVICE).to(dtype)
    whole, whole_lse = run_prefill(q, kv, cu_of([n]), 0.125, window=window)
    parts, lses = [], []
    for a, b in ((0, 50), (50, 71), (71, 140), (140, 141), (141, 300)):
        chunk = Paged.__new__(Paged)
        chunk.k, chunk.v, chunk.block_tables, chunk.page = kv.k, kv.v, kv.block_tables, 16
        chunk.lens = [b]
        chunk.seq_lens = torch.tensor([b], dtype=torch.int32, device=DEVICE)
        o, lse = run_prefill(q[a:b], chunk, cu_of([b - a]), 0.125, window=window,
                             config=(32, 16, 4, 1))  # fmt: skip
        parts.append(o)
        lses.append(lse)
    assert_close(torch.cat(parts), whole.double(), TOL[dtype], "chunked vs whole out")
    assert_close(torch.cat(lses), whole_lse.double(), LSE_TOL[dtype], "chunked vs whole lse")
    ref_out, _ = prefill_ref(q, kv, cu_of([n]), 0.125, window=window)
    assert_close(whole, ref_out, TOL[dtype], "whole prompt out")


def poison_left_of(kv: Paged, starts):
    """A copy of ``kv`` in which every token left of ``starts[b]`` is NaN in its own slot, and
    the block-table entries of the pages wholly left of it point at a page of NaN: pages that
    "memory follows the window" may have freed and handed to another sequence. Reading any of
    them, even masked and then multiplied by zero, puts NaN in the output."""
    bad = Paged.__new__(Paged)
    bad.lens, bad.page, bad.seq_lens = kv.lens, kv.page, kv.seq_lens
    nan = torch.full_like(kv.k[:1], float("nan"))
    bad.k, bad.v = torch.cat([kv.k, nan]), torch.cat([kv.v, nan])
    bad.block_tables = kv.block_tables.clone()
    for b, start in enumerate(starts):
        whole, part = divmod(start, kv.page)
        rows = bad.block_tables[b, :whole].long()
        bad.k[rows], bad.v[rows] = float("nan"), float("nan")
        bad.block_tables[b, :whole] = kv.k.shape[0]  # the NaN page
        if part:
            first = bad.block_tables[b, whole].long()
            bad.k[first, :part], bad.v[first, :part] = float("nan"), float("nan")
    return bad


@pytest.mark.parametrize("page,tiles", [(16, (64, 4, 2)), (64, (16, 4, 2)), (16, (16, 4, 2))])
def test_decode_never_reads_left_of_the_window(page, tiles):
    lens, window = [600, 301, 65, 150], 130
    kv = Paged(lens, 2, 64, page, torch.float16)
    bad = poison_left_of(kv, [max(0, n - window) for n in lens])
    q = torch.randn(len(lens), 8, 64, device=DEVICE).half()
    ref_out, _ = decode_ref(q, kv, 0.125, window=window)
    ref_bad, _ = decode_ref(q, bad, 0.125, window=window)
    assert torch.equal(ref_bad, ref_out)  # the reference reads only the window's pages too
    for kw in ({"num_splits": 1}, {"split_size": 128}):
        kw["tuning"] = DecodeTuning(tiles=tiles)
        clean, clean_lse = run_decode(q, kv, 0.125, window=window, **kw)
        out, lse = run_decode(q, bad, 0.125, window=window, softcap=30.0, **kw)
        capped, capped_lse = run_decode(q, kv, 0.125, window=window, softcap=30.0, **kw)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), kw
        assert torch.equal(out, capped) and torch.equal(lse, capped_lse), kw
        out, lse = run_decode(q, bad, 0.125, window=window, **kw)
        assert torch.equal(out, clean) and torch.equal(lse, clean_lse), kw
        assert_close(out, ref_out, TOL[torch.float16], f"decode, poisoned pages {kw}")


@pytest.mark.parametrize("page,config", [(16, (32, 16, 4, 1)), (16, (16, 32, 4, 1)),
                                         (64, (32, 32, 4, 1))])  # fmt: skip
def test_prefill_never_reads_left_of_the_window(page, config):
    qlens, ctx, window = [40, 100, 1], [300, 20, 200], 75
    lens = [a + b for a, b in zip(qlens, ctx)]
    kv = Paged(lens, 2, 64, page, torch.float16)
    bad = poison_left_of(kv, [max(0, c - window + 1) for c in ctx])  # each chunk's first query
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), 4, 64, device=DEVICE).half()
    ref_out, _ = prefill_ref(q, kv, cu, 0.125, window=window)
    assert torch.equal(prefill_ref(q, bad, cu, 0.125, window=window)[0], ref_out)
    for softcap in (0.0, 30.0):
        clean, clean_lse = run_prefill(q, kv, cu, 0.125, window=window, softcap=softcap,
                                       config=config)  # fmt: skip
        out, lse = run_prefill(q, bad, cu, 0.125, window=window, softcap=softcap,
                               config=config)  # fmt: skip
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), softcap
        assert torch.equal(out, clean) and torch.equal(lse, clean_lse), softcap
    assert_close(run_prefill(q, bad, cu, 0.125, window=window, config=config)[0], ref_out,
                 TOL[torch.float16], "prefill, poisoned pages")  # fmt: skip


@pytest.mark.parametrize(
    "kw, field", [({"window": -1}, "window"), ({"window": 2.5}, "window"),
                  ({"softcap": -1.0}, "softcap"), ({"softcap": float("nan")}, "softcap")],
)  # fmt: skip
def test_window_and_softcap_are_checked(kw, field):
    kv = Paged([20], 1, 64, 16, torch.float16)
    q = torch.randn(1, 2, 64, device=DEVICE).half()
    with pytest.raises(ValueError, match=field):
        run_decode(q, kv, 0.125, **kw)
    with pytest.raises(ValueError, match=field):
        run_prefill(q, kv, cu_of([1]), 0.125, **kw)
