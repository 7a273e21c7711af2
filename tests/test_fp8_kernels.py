"""Float8 (e4m3) weights: quantization (``kernels.quant``), the weight-streaming GEMV on fp8
weights (``kernels.gemv``, M <= 16) and the prefill paths (``kernels.fp8``: the block-scaled
Triton GEMM, ``torch._scaled_mm`` per channel), each against float64 math on the dequantized
weight (``q * scale``).

Without a GPU the Triton kernels run in the interpreter on CPU tensors, with fp16/fp32
activations (its bf16 ``tl.dot`` is wrong). Its float8 loads, widening and fp8 ``tl.dot`` are
right, so the block GEMM runs there on real e4m3 operands; its float32 -> e4m3 cast is not
(124.3 became 64, ties round away from zero), so the activation quantizer's codes are checked
on the GPU only. The GPU tests (``gpu`` marker) take bf16 at Llama-3-8B shapes, CUDA-graph
replay, and the prefill paths at M = 17..4096, where activations are fp8 too: each token's
output within e4m3's 1/16 of the exact product.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import (  # noqa: E402
    DEVICE,
    GEMV_DTYPES,
    GEMV_TOL,
    QUANTIZE,
    assert_close,
    capture_graph,
)

from kernels import fp8, quant  # noqa: E402
from kernels.gemv import gemv_config, linear, linear_small_m  # noqa: E402
from kernels.quant import E4M3, E4M3_MAX, MIN_SCALE  # noqa: E402


def _weight(n: int, k: int, scales: str, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's e4m3 codes and scales; rows of very different magnitudes, so that a
    scale applied to the wrong row or block shows."""
    spread = (torch.rand(n, 1, device=device) * 6 - 3).exp2_()  # 1/8 .. 8
    w = torch.randn(n, k, device=device) * spread * 0.02
    return QUANTIZE[scales](w)


def _ref(x, q, scale, bias=None) -> torch.Tensor:  # float64 [M, N]
    out = x.double() @ quant.dequantize(q, scale, torch.float64).T
    return out + bias.double() if bias is not None else out


def _e4m3_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of ``w`` quantized with ``scale`` (same shape): half a step of
    e4m3, 2^-4 of the value in its normal range, 2^-10 * scale among the subnormals."""
    return torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


# ---------------------------------------------------------------- kernels.quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_scales_and_round_trip(dtype):
    w = (torch.randn(67, 300) * torch.logspace(-4, 2, 67)[:, None]).to(dtype)
    q, scale = quant.quantize_per_channel(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (67,)
    torch.testing.assert_close(scale, w.float().abs().amax(1) / E4M3_MAX, rtol=0, atol=0)
    assert (q.float().abs().amax(1) == E4M3_MAX).all()  # each row's largest maps to 448
    back = quant.dequantize(q, scale, torch.float32)
    err = (back - w.float()).abs()
    bound = _e4m3_bound(w.float(), scale[:, None])
    assert (err <= bound).all(), f"worst {(err / bound).max():.3f} of e4m3's bound"


def test_block_scales_and_round_trip():
    w = torch.randn(300, 260) * torch.logspace(-3, 1, 300)[:, None]  # partial edge blocks
    q, scale = quant.quantize_blocks(w)
    assert scale.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j] == block.abs().max() / E4M3_MAX, (i, j)
    full = quant.expand_block_scales(scale, 300, 260)
    err = (quant.dequantize(q, scale, torch.float32) - w).abs()
    assert (err <= _e4m3_bound(w, full)).all()


def test_zero_rows_and_huge_values_stay_finite():
    """A zero row gets MIN_SCALE and zero codes; values near float32's limit, and infinities,
    clamp to +-448 instead of becoming NaN."""
    w = torch.randn(4, 64)
    w[1] = 0
    w[2, 5] = 3e38
    w[3, 7], w[3, 9] = float("inf"), -float("inf")
    for fn in (quant.quantize_per_channel, quant.quantize_blocks):
        q, scale = fn(w)
        assert not q.float().isnan().any() and scale.isfinite().all(), fn.__name__
        assert (scale >= MIN_SCALE).all()
    q, scale = quant.quantize_per_channel(w)
    assert scale[1] == MIN_SCALE and (q[1].float() == 0).all()
    assert q[2, 5].float() == E4M3_MAX and q[3, 7].float() == E4M3_MAX
    assert q[3, 9].float() == -E4M3_MAX
    assert quant.dequantize(q, scale, torch.float32)[2, 5] == pytest.approx(3e38, rel=1e-6)


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_reference(group):
    x = torch.randn(9, 300) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    q, scale = quant.quantize_activations(x, group)
    g = group or 300
    assert scale.shape == (9, -(-300 // g))
    full = scale.repeat_interleave(g, 1)[:, :300]
    assert scale[4].eq(MIN_SCALE).all() and not q.float().isnan().any()
    err = (q.float() * full - x).abs()
    assert (err <= _e4m3_bound(x, full)).all()


# ---------------------------------------------------------------- GEMV (M <= 16)


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(17, 300), (257, 384), (131, 1000)])
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_dequantized_reference(dtype, m, n, k, scales, bias):
    q, scale = _weight(n, k, scales)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    got = linear_small_m(x, q, b, out=out, weight_scale=scale)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, _ref(x, q, scale, b), GEMV_TOL[dtype], f"{scales} M={m} N={n} K={k}")


@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_gemv_every_m(scales):
    """M = 1..16 (x's rows loaded as the next power of two, repeated to the dot's 16), fp16
    activations, odd N and K (a K tail)."""
    n, k = 75, 333
    q, scale = _weight(n, k, scales)
    for m in range(1, 17):
        x = torch.randn(m, k, device=DEVICE).half()
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float16)
        linear_small_m(x, q, out=out, weight_scale=scale)
        assert_close(out, _ref(x, q, scale), GEMV_TOL[torch.float16], f"{scales} M={m}")


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): K tiles under one 128-block (one scale
# per tile), over several blocks (128-column parts) with a K tail, split K (scales per row apply
# once, after the split sum)
FP8_CONFIGS = [(16, 64, 3, 4, 2), (32, 256, 2, 4, 2), (16, 128, 8, 4, 2), (64, 512, 1, 4, 2)]


@pytest.mark.parametrize("config", FP8_CONFIGS)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_gemv_configs_and_split_k(config, m, scales):
    n, k = 200, 700
    q, scale = _weight(n, k, scales)
    x = torch.randn(m, k, device=DEVICE).half()
    b = torch.randn(n, device=DEVICE).half()
    out = linear_small_m(x, q, b, weight_scale=scale, config=config)
    assert_close(out, _ref(x, q, scale, b), GEMV_TOL[torch.float16], f"{scales} {config}")


# diag (M <= 8, x's rows in 8 / M chunks): BLOCK_K 128 (chunks of 16 at M = 1, the dot's K)
# and 256 (two 128-column parts with block scales), unsplit and split, K with a tail
DIAG_CONFIGS = [(16, 128, 1, 1, 2), (32, 256, 3, 1, 2), (16, 256, 2, 2, 3), (64, 128, 1, 4, 2)]


@pytest.mark.parametrize("config", DIAG_CONFIGS)
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fp8_gemv_diag_matches_reference(config, scales, m):
    """``diag`` (M rows of 8 / M chunks; 3 rows as 4, the fourth never stored): the same sums
    as the float64 reference (and as without diag) over K with a tail (700, 1000) and one that
    ends on a part (1152), a bias, and the gated epilogue."""
    for n, k in [(200, 700), (96, 1000), (128, 1152)]:  # the last one gated too (I = 64)
        q, scale = _weight(n, k, scales)
        x = torch.randn(m, k, device=DEVICE).half()
        b = torch.randn(n, device=DEVICE).half()
        got = linear_small_m(x, q, b, weight_scale=scale, config=config, diag=True)
        want = _ref(x, q, scale, b)
        assert_close(got, want, GEMV_TOL[torch.float16], f"{scales} {config} N={n} K={k}")
        plain = linear_small_m(x, q, b, weight_scale=scale, config=config)
        assert_close(got, plain.double(), GEMV_TOL[torch.float16], f"diag vs not {config}")
    gated = linear_small_m(x, q, weight_scale=scale, config=config, act="silu", diag=True)
    g, u = want.sub(b.double()).chunk(2, dim=1)
    assert_close(gated, torch.nn.functional.silu(g) * u, GEMV_TOL[torch.float16], f"gated {config}")


def test_fp8_gemv_diag_refuses_what_it_cannot_take():
    q, scale = _weight(64, 512, "channel")
    for what, m, config in [("nine rows", 9, None), ("BLOCK_K 64", 1, (16, 64, 1, 1, 2))]:
        x = torch.randn(m, 512, device=DEVICE).half()
        with pytest.raises(ValueError, match="diag takes M <= 8"):
            linear_small_m(x, q, weight_scale=scale, config=config, diag=True)
            pytest.fail(what)


def _bf16_rows(m: int, k: int, magnitudes: list[float]) -> torch.Tensor:
    """bf16 activations whose row i has magnitude ``magnitudes[i % len]`` (the largest element
    of a row is about 4x that)."""
    mag = torch.tensor(magnitudes, device=DEVICE).repeat(-(-m // len(magnitudes)))[:m, None]
    return (torch.randn(m, k, device=DEVICE) * mag).to(torch.bfloat16)


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m,diag", [(1, False), (1, True), (4, False), (4, True), (16, False)])
def test_fp8_gemv_bf16_rows_outside_f16_range(scales, m, diag):
    """bf16 x meets f16 operands: rows past 65504 (they would be inf) or with no element over
    2^-10 (subnormal in f16) are scaled by a power of two and their steps run again; rows in
    range beside them stay right. The interpreter reads bf16 and widens it correctly."""
    n, k = 96, 300
    q, scale = _weight(n, k, scales)
    config = (16, 128, 1, 1, 2) if diag else None
    for magnitudes in ([1e5], [3e-5], [1.0, 2e5, 1e-6, 0.5], [0.0, 1.0]):
        x = _bf16_rows(m, k, magnitudes)
        got = linear_small_m(x, q, weight_scale=scale, config=config, diag=diag).float()
        ref = _ref(x, q, scale)
        for i in range(m):  # each row against its own size: a huge row would hide a tiny one
            what = f"{scales} M={m} row {i} of magnitude {magnitudes[i % len(magnitudes)]:g}"
            if ref[i].abs().max() == 0:
                assert (got[i] == 0).all(), what
            else:
                assert_close(got[i], ref[i], GEMV_TOL[torch.bfloat16], what)


@pytest.mark.parametrize("magnitude", [1e-36, 1e-38])
def test_fp8_gemv_bf16_rows_too_small_for_any_shift_stay_finite(magnitude):
    """A row under 2^-113 would need a shift past float32's range (2^-e overflowed: NaN in
    every output): it is scaled by 2^100 at most, so it comes out finite and near its (tiny)
    value, where f16's subnormals keep a few bits."""
    n, k = 64, 256
    q, scale = _weight(n, k, "channel")
    x = _bf16_rows(2, k, [magnitude, 1.0])
    got = linear_small_m(x, q, weight_scale=scale).float()
    ref = _ref(x, q, scale)
    assert torch.isfinite(got).all(), got
    # within 20% at 1e-36; at 1e-38 (bf16 and float32 subnormals) only bounded
    bound = 0.2 if magnitude > 1e-37 else 2.0
    assert (got[0] - ref[0]).abs().max() <= bound * ref[0].abs().max(), (got[0], ref[0])
    assert_close(got[1], ref[1], GEMV_TOL[torch.bfloat16], "the row in range beside it")


@pytest.mark.parametrize("config", [None, (64, 256, 1, 4, 4)])
def test_fp8_gemv_block_scales_read_none_past_the_row(config):
    """K = 9 blocks of 128 with 256-column K steps: the last step's second 128-column part lies
    wholly past K and has no scale block; reading one there (the next row's, or past the
    tensor) gave NaN when it held NaN (0 * NaN). The scale tensor here is followed by NaN."""
    n, k = 128, 1152
    q, scale = _weight(n, k, "block")
    rows, cols = scale.shape
    room = torch.full((rows * cols + 8,), float("nan"), dtype=scale.dtype, device=scale.device)
    room[: rows * cols] = scale.flatten()
    poisoned = room[: rows * cols].view(rows, cols)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.float16)
    got = linear_small_m(x, q, weight_scale=poisoned, config=config).float()
    assert_close(got, _ref(x, q, scale), GEMV_TOL[torch.float16], f"block scales, config {config}")


def test_fp8_gemv_heuristic_tiles():
    """fp8 tiles at Llama-3-8B shapes on 132 SMs (the 2026-11-27 sweeps): gate_up 2-warp
    tiles of 128 rows, qkv, o_proj and down one-warp 16-row diag tiles unsplit (M = 1, per
    channel; block scales: 16-row tiles without diag from 2.5 programs an SM, else 32-row ones
    split); M > 1 unsplit, no diag; narrower layers 32-row tiles split to fill the SMs. Every
    tile on tl.dot (BLOCK_N >= 16), sharing its 128x128 blocks' scale rows, K in whole
    tiles."""
    picks = {}
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]:
        for m in (1, 8, 16):
            for w_scale in (1, 2):
                cfg = gemv_config(m, n, k, 132, w_scale)
                block_n, block_k, split, _, _, diag = cfg
                assert k % block_k == 0 and 16 <= block_n <= 128 and 128 % block_n == 0, cfg
                programs = split * n // block_n  # ~3.5 an SM, or splits of 512 columns
                assert split == 1 or (m == 1 and (3 * 132 <= programs <= 5 * 132
                                                  or split == k // 512)), cfg  # fmt: skip
                assert not diag or (m == 1 and block_k >= 128 and w_scale == 1), cfg
                picks[(m, n, k, w_scale)] = cfg
    assert picks[(1, 28672, 4096, 1)] == (128, 128, 1, 2, 4, False)
    assert picks[(1, 6144, 4096, 1)] == (16, 256, 1, 1, 6, True)
    assert picks[(1, 4096, 4096, 1)] == (16, 256, 1, 1, 6, True)
    assert picks[(1, 4096, 4096, 2)] == (32, 128, 4, 1, 6, False)
    assert picks[(1, 6144, 4096, 2)] == (16, 256, 1, 1, 6, False)
    assert picks[(1, 4096, 14336, 1)] == (16, 256, 1, 1, 6, True)
    assert picks[(1, 1024, 4096, 1)] == (32, 128, 8, 1, 6, False)
    assert picks[(8, 4096, 14336, 1)][2] == 1
    # a short K caps the splits at 512 columns each
    assert gemv_config(1, 1024, 1024, 132, 1)[2] == 2


def test_fp8_gemv_errors():
    x = torch.randn(2, 256, device=DEVICE).half()
    q, scale = _weight(64, 256, "channel")
    qb, bscale = _weight(64, 256, "block")
    bad = {
        "no scale": (q, None, None),
        "scale shape": (q, scale[:10], None),
        "scale dtype": (q, scale.half(), None),
        "scale of a float weight": (q.half(), scale, None),
        "BLOCK_N 256 with blocks": (qb, bscale, (256, 64, 1, 4, 2)),
        "BLOCK_N 8 (tl.dot)": (q, scale, (8, 64, 1, 4, 2)),
    }
    for what, (w, s, config) in bad.items():
        with pytest.raises(ValueError):
            linear_small_m(x, w, weight_scale=s, config=config)
            pytest.fail(f"no ValueError for {what}")


# ---------------------------------------------------------------- prefill paths (M > 16)


@pytest.mark.parametrize("m,n,k", [(17, 100, 300), (40, 257, 384), (65, 130, 128)])
@pytest.mark.parametrize("config", [None, (16, 32, 4, 2), (32, 128, 4, 3)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_block_fp8_matmul(m, n, k, config, out_dtype):
    """Real e4m3 operands in the interpreter too; against the float64 product of the same
    quantized activations and weights."""
    x = torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, m, device=DEVICE)[:, None]
    xq, xs = quant.quantize_activations(x, 128)
    q, scale = _weight(n, k, "block")
    b = torch.randn(n, device=DEVICE)
    got = fp8.block_fp8_matmul(xq, xs, q, scale, b, out_dtype, config=config)
    x_deq = xq.double() * xs.double().repeat_interleave(128, 1)[:, :k]
    ref = x_deq @ quant.dequantize(q, scale, torch.float64).T + b.double()
    assert got.dtype == out_dtype
    assert_close(got, ref, GEMV_TOL[out_dtype], f"M={m} N={n} K={k} {config}")


def test_quantized_activation_scales():
    """The Triton quantizer's scales (its codes need a GPU: module doc)."""
    x = torch.randn(20, 300, device=DEVICE).half() * 3
    x[3] = 0
    for group in (None, 128):
        _, s = fp8.quantize_activations(x, group)
        _, ref = quant.quantize_activations(x, group)
        torch.testing.assert_close(s, ref, rtol=1e-6, atol=0)


def test_fp8_linear_off_cuda_is_the_reference():
    """Where there are no fp8 tensor cores (the torch backend's CPU), ``linear`` dequantizes
    then multiplies: the reference exactly."""
    from kernels import reference

    x = torch.randn(33, 256)
    for scales in ("channel", "block"):
        q, scale = _weight(96, 256, scales, device="cpu")
        want = torch.nn.functional.linear(x, quant.dequantize(q, scale, torch.float32))
        assert torch.equal(reference.linear(x, q, None, scale), want)
        assert torch.equal(fp8.fp8_linear(x, q, scale), want)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_gemv_llama_shapes_bf16(n, k, m, scales):
    """Llama-3-8B shapes, the heuristic's tiles (gate_up: 2-warp mma.sync; at M = 1 qkv
    one-warp 16-row tiles, o_proj and down 32-row ones split in 4; M > 1 wgmma)."""
    q, scale = _weight(n, k, scales)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = linear_small_m(x, q, b, weight_scale=scale)
    assert_close(out, _ref(x, q, scale, b), GEMV_TOL[torch.bfloat16], f"{scales} M={m} N={n} K={k}")


# one tile of each kind ``kernels.bench_fp8 --sweep`` times: mma.sync with 2 warps of 64 rows and
# with 1, one warp of 16 and 32 rows, wgmma with 4 warps (BLOCK_K 256: two block-scale parts,
# and 128) and 8; unsplit and split in 3
SWEEP_KINDS = [
    (128, 128, 2, 4),
    (16, 256, 1, 6),
    (32, 128, 1, 6),
    (64, 256, 1, 3),
    (64, 256, 4, 4),
    (64, 128, 4, 6),
    (128, 128, 8, 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", SWEEP_KINDS)
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_gemv_tile_kinds_bf16(tile, split, scales):
    """Each kind of tile the sweep times (their layouts exist only on the GPU: the interpreter
    runs none of them), bf16 x, M = 1, 5 and 16, K with a tail; M = 1 and 5 with diag too (its
    reshaped weight tile and 8-column dot), with a gated epilogue."""
    n, k = 1000, 4000
    q, scale = _weight(n, k, scales)
    # gated with block scales: I a multiple of 128 (each half's rows in whole block rows)
    gq, gscale = (q, scale) if scales == "channel" else _weight(1024, k, scales)
    config = (*tile[:2], split, *tile[2:])
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = linear_small_m(x, q, weight_scale=scale, config=config)
        assert_close(out, _ref(x, q, scale), GEMV_TOL[torch.bfloat16], f"{scales} {tile} M={m}")
    for m in (1, 5) if tile[1] >= 128 else ():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = linear_small_m(x, q, weight_scale=scale, config=config, diag=True)
        assert_close(
            out, _ref(x, q, scale), GEMV_TOL[torch.bfloat16], f"{scales} {tile} M={m} diag"
        )
        gated = linear_small_m(x, gq, weight_scale=gscale, config=config, act="silu", diag=True)
        g, u = _ref(x, gq, gscale).chunk(2, dim=1)
        want = torch.nn.functional.silu(g) * u
        assert_close(gated, want, GEMV_TOL[torch.bfloat16], f"{scales} {tile} M={m} diag gated")


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_gemv_cuda_graph_replay(scales):
    n, k, m = 2048, 4096, 4
    q, scale = _weight(n, k, scales)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    graph, out = capture_graph(lambda: linear_small_m(x, q, weight_scale=scale))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, _ref(x, q, scale), GEMV_TOL[torch.bfloat16], f"graph {scales}")


@pytest.mark.gpu
@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantizer_codes_on_gpu(group):
    """Scales as the reference's; codes equal but for the odd last-bit tie (the kernel divides
    with div.full, torch exactly): never more than one e4m3 step apart."""
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16) * 4
    q, s = fp8.quantize_activations(x, group)
    rq, rs = quant.quantize_activations(x, group)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    a, b = q.float(), rq.float()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2**-6))) - 3)
    assert ((a - b).abs() <= step).all()
    assert (a != b).float().mean() < 0.01


def _per_token_rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:  # [M]
    return (out.double() - ref).norm(dim=1) / ref.norm(dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 300, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_fp8_prefill_paths_bf16(m, n, k, scales):
    """``linear`` above 16 rows (the Triton backend's op): per channel through
    ``torch._scaled_mm``, blocks through ``block_fp8_matmul``, activations quantized to e4m3
    per token (and 128-column group). Each token's output within 1/16 of the exact product
    with the dequantized weight; and within bf16 rounding of the product of the quantized
    activations (the kernel's own arithmetic)."""
    if m == 4096 and k == 14336:
        pytest.skip("the float64 reference at 4096 x 14336 x 4096 takes too long")
    q, scale = _weight(n, k, scales)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = linear(x, q, b, scale)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    exact = _ref(x, q, scale, b)
    worst = _per_token_rel_err(out, exact).max().item()
    assert worst <= 1 / 16, f"{scales} M={m}: worst token rel err {worst:.3e}"
    xq, xs = quant.quantize_activations(x, 128 if scales == "block" else None)
    g = 128 if scales == "block" else k
    x_deq = (xq.double() * xs.double().repeat_interleave(g, 1)[:, :k]).to(torch.float64)
    assert_close(out, _ref(x_deq, q, scale, b), 2e-2, f"{scales} M={m} vs quantized x")
