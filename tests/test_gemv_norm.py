"""The RMSNorm between two decode GEMVs folded into them (kernels.gemv): the producing GEMV
adds its output to the residual stream and leaves each tile's sum of squares
(``linear_small_m(residual=)``, ``linear_add``); the consuming one norms x as it loads it from
those sums (``norm=RowNorm``), so the norm's kernel goes. Checked against float64 references
on the rounded values ``kernels.reference`` defines (``linear_add``, ``rows_normed``).

Without a GPU the kernels run in Triton's interpreter at toy sizes in fp16 and fp32 (it
miscomputes tl.dot on bf16); with one, bf16 too, at Llama-3-8B shapes and under CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import (  # noqa: E402
    DEVICE,
    GEMV_DTYPES,
    GEMV_TOL,
    GPU,
    QUANTIZE,
    assert_close,
    capture_graph,
)

from kernels import quant  # noqa: E402
from kernels import reference as torch_ops  # noqa: E402
from kernels.gemv import (  # noqa: E402
    fuses_norms,
    linear,
    linear_add,
    linear_small_m,
    norm_fold_pays,
)
from kernels.norm import add_rms_norm  # noqa: E402
from kernels.reference import RowNorm  # noqa: E402

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) and diag: the elementwise M = 1 loop
# (None at M = 1), tl.dot, diag on one and four warps, split over K with a K tail
CONFIGS = [
    (None, False),
    ((16, 64, 1, 4, 2), False),
    ((16, 128, 1, 1, 2), True),
    ((32, 64, 3, 4, 2), False),
    ((32, 128, 2, 1, 3), True),
]


def weights(n, k, dtype, scales=None):
    """A random weight [n, k] (or e4m3 with its scales) and its float64 values."""
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    if scales is None:
        w = w.to(dtype)
        return w, None, w.double()
    q, s = QUANTIZE[scales](w)
    return q, s, quant.dequantize(q, s, torch.float64)


def stream(m, k, dtype):
    """A residual-stream x [m, k] whose rows' scales differ by 100x."""
    return (torch.randn(m, k, device=DEVICE) * torch.logspace(-1, 1, m, device=DEVICE)[:, None]
            ).to(dtype)  # fmt: skip


def split_sums(x, parts):
    """x's rows' sums of squares in ``parts`` uneven column pieces, float32 [M, parts]."""
    cuts = torch.linspace(0, x.shape[1], parts + 1).long().tolist()
    sq = x.float().square()
    return torch.stack([sq[:, a:b].sum(1) for a, b in zip(cuts, cuts[1:])], 1).contiguous()


# ---------------------------------------------------------------- the producer: residual add


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config,diag", CONFIGS)
def test_residual_add_and_tile_sums(dtype, m, config, diag):
    """out = residual + x @ w.T + b, the product rounded first; sumsq[:, j] = the sum of out**2
    over tile j's columns (N = 72: a partial last tile)."""
    if diag and m > 8:
        pytest.skip("diag takes M <= 8")
    n, k = 72, 300
    x, r = torch.randn(m, k, device=DEVICE).to(dtype), stream(m, n, dtype)
    w, _, w64 = weights(n, k, dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    out, sumsq = linear_small_m(x, w, b, config=config, diag=diag, residual=r)
    product = linear_small_m(x, w, b, config=config, diag=diag)
    assert out.shape == (m, n) and out.dtype == dtype
    assert torch.equal(out, (r.float() + product.float()).to(dtype)), "rounded, added, rounded"
    assert_close(out, r.double() + x.double() @ w64.T + b.double(), GEMV_TOL[dtype], "the sum")
    assert sumsq.dtype == torch.float32 and sumsq.shape[0] == m
    assert_close(sumsq.double().sum(1), out.double().square().sum(1), 1e-5, "row sums")
    if config:  # the heuristic's tile is the device's
        assert sumsq.shape[1] == triton.cdiv(n, config[0])
        tiles = out.double().square().split(config[0], dim=1)
        want = torch.stack([t.sum(1) for t in tiles], 1)
        assert_close(sumsq, want, 1e-5, "each tile's sum of squares")


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 5])
def test_residual_add_fp8_weights(scales, m):
    """e4m3 weights (per channel, 128x128 blocks) at the heuristic's tiles: the same sums."""
    n, k = 200, 260
    x, r = torch.randn(m, k, device=DEVICE).half(), stream(m, n, torch.float16)
    w, s, w64 = weights(n, k, None, scales)
    out, sumsq = linear_small_m(x, w, weight_scale=s, residual=r)
    assert_close(out, r.double() + x.double() @ w64.T, GEMV_TOL[torch.float16], f"{scales} sum")
    assert_close(sumsq.double().sum(1), out.double().square().sum(1), 1e-5, "row sums")


# ---------------------------------------------------------------- the consumer: x normed


def normed_reference(x, sumsq, nw, eps, w64, bias=None):
    """rms_norm(x) @ w.T (+ b) in float64, x normed with the reference's rounding."""
    xn = torch_ops.rows_normed(x, RowNorm(sumsq, nw, eps)).double()
    ref = xn @ w64.T
    return ref + bias.double() if bias is not None else ref


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config,diag", CONFIGS)
@pytest.mark.parametrize("parts", [1, 7, 300])
def test_norm_applied_as_x_loads(dtype, m, config, diag, parts):
    """x @ w.T of rms_norm(x) from ``parts`` partial sums of squares (300: more than one
    chunk of the kernel's loads), K = 300 with a tail, a bias."""
    n, k, eps = 40, 300, 1e-5
    x = stream(m, k, dtype)
    w, _, w64 = weights(n, k, dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    nw = (1 + 0.5 * torch.randn(k, device=DEVICE)).to(dtype)
    sumsq = split_sums(x, parts)
    got = linear_small_m(x, w, b, config=config, diag=diag, norm=RowNorm(sumsq, nw, eps))
    assert_close(got, normed_reference(x, sumsq, nw, eps, w64, b), GEMV_TOL[dtype],
                 f"M={m} {config} diag={diag} P={parts}")  # fmt: skip


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_norm_fp8_and_gated(scales, act, m):
    """e4m3 weights at the heuristic's tiles (diag at M = 1 per channel), plain and gated."""
    n, k, eps = 256, 384, 1e-6
    x = stream(m, k, torch.float16)
    w, s, w64 = weights(n, k, None, scales)
    nw = (1 + 0.5 * torch.randn(k, device=DEVICE)).half()
    sumsq = split_sums(x, 5)
    got = linear_small_m(x, w, weight_scale=s, act=act, norm=RowNorm(sumsq, nw, eps))
    ref = normed_reference(x, sumsq, nw, eps, w64)
    if act:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    assert_close(got, ref, GEMV_TOL[torch.float16], f"{scales} act={act} M={m}")


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 4])
def test_producer_then_consumer_is_add_norm_then_linear(dtype, m):
    """linear_add, then linear(norm=) on its sums: the residual and the product that
    add_rms_norm between two plain projections gives."""
    h, k2, n, eps = 96, 80, 48, 1e-5
    a, r = torch.randn(m, k2, device=DEVICE).to(dtype), stream(m, h, dtype)
    w1, _, _ = weights(h, k2, dtype)
    w2, _, w2_64 = weights(n, h, dtype)
    nw = (1 + 0.5 * torch.randn(h, device=DEVICE)).to(dtype)
    stream_out, sumsq = linear_small_m(a, w1, residual=r)
    got = linear_small_m(stream_out, w2, norm=RowNorm(sumsq, nw, eps))
    normed, residual = add_rms_norm(linear_small_m(a, w1), r, nw, eps)
    assert torch.equal(stream_out, residual), "the residual stream, bit for bit"
    assert_close(got, normed.double() @ w2_64.T, GEMV_TOL[dtype], "the normed product")


@pytest.mark.skipif(GPU, reason="the CPU's path: tensors off CUDA")
def test_linear_add_and_norm_off_the_gemv():
    """Where the GEMV does not stream (CPU tensors, prefill sizes): linear_add sums each row
    once and linear(norm=) runs the norm's kernel first; the same values as the reference."""
    m, h, k2, n, eps = 20, 96, 80, 48, 1e-5
    a, r = torch.randn(m, k2).half(), stream(m, h, torch.float16).cpu()
    w1, w2 = torch.randn(h, k2).half() / 9, torch.randn(n, h).half() / 9
    nw = (1 + 0.5 * torch.randn(h)).half()
    out, sumsq = linear_add(a, w1, None, None, r)
    want, want_sq = torch_ops.linear_add(a, w1, None, None, r)
    assert torch.equal(out, want) and sumsq.shape == (m, 1)
    assert_close(sumsq, want_sq.double(), 1e-6, "row sums")
    got = linear(out, w2, norm=RowNorm(sumsq, nw, eps))
    ref = torch_ops.linear(out, w2, norm=RowNorm(sumsq, nw, eps))
    assert_close(got, ref.double(), GEMV_TOL[torch.float16], "normed product")


def test_errors():
    """Operands that do not fit are refused with a message naming them."""
    x = torch.randn(2, 64, device=DEVICE).half()
    w = torch.randn(32, 64, device=DEVICE).half()
    sums = torch.ones(2, 3, device=DEVICE)
    nw = torch.ones(64, device=DEVICE).half()
    with pytest.raises(ValueError, match="residual"):
        linear_small_m(x, w, residual=torch.zeros(2, 31, device=DEVICE).half())
    with pytest.raises(ValueError, match="residual"):
        linear_small_m(x, w, residual=torch.zeros(2, 16, device=DEVICE).half(), act="silu")
    with pytest.raises(ValueError, match="norm's weight"):
        linear_small_m(x, w, norm=RowNorm(sums, nw.float(), 1e-6))
    with pytest.raises(ValueError, match="norm's sums"):
        linear_small_m(x, w, norm=RowNorm(sums[:1], nw, 1e-6))
    with pytest.raises(ValueError, match="norm's sums"):
        linear_small_m(x, w, norm=RowNorm(sums.double(), nw, 1e-6))


# ---------------------------------------------------------------- GPU: model shapes, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("scales", [None, "channel", "block"])
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_llama_layer_shapes(scales, m):
    """Llama-3-8B's o_proj into gate/up and down into qkv, heuristic tiles, bf16 activations
    (bf16 or e4m3 weights): each pair against add_rms_norm between the unfused GEMVs."""
    dtype, eps = torch.bfloat16, 1e-5
    for (n1, k1), (n2, k2), act in [((4096, 4096), (28672, 4096), "silu"),
                                    ((4096, 14336), (6144, 4096), None)]:  # fmt: skip
        a, r = torch.randn(m, k1, device=DEVICE).to(dtype), stream(m, n1, dtype)
        w1, s1, _ = weights(n1, k1, dtype, scales)
        w2, s2, _ = weights(n2, k2, dtype, scales)
        nw = (1 + 0.5 * torch.randn(n1, device=DEVICE)).to(dtype)
        h, sumsq = linear_small_m(a, w1, weight_scale=s1, residual=r)
        got = linear_small_m(h, w2, weight_scale=s2, act=act, norm=RowNorm(sumsq, nw, eps))
        normed, residual = add_rms_norm(linear_small_m(a, w1, weight_scale=s1), r, nw, eps)
        want = linear_small_m(normed, w2, weight_scale=s2, act=act)
        assert torch.equal(h, residual), f"{scales} M={m} the residual stream"
        assert_close(got, want.double(), GEMV_TOL[dtype], f"{scales} M={m} N={n2} act={act}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay(m):
    """The pair in one graph: replays with new inputs give fresh, correct results."""
    dtype, eps = torch.bfloat16, 1e-6
    a = torch.randn(m, 4096, device=DEVICE, dtype=dtype)
    r = stream(m, 4096, dtype)
    w1, s1, _ = weights(4096, 4096, dtype, "channel")
    w2, _, _ = weights(6144, 4096, dtype)
    nw = (1 + 0.5 * torch.randn(4096, device=DEVICE)).to(dtype)

    def pair():
        h, sumsq = linear_small_m(a, w1, weight_scale=s1, residual=r)
        return h, linear_small_m(h, w2, norm=RowNorm(sumsq, nw, eps))

    graph, (h, out) = capture_graph(pair)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        r.copy_(stream(m, 4096, dtype))
        graph.replay()
        torch.cuda.synchronize()
        normed, residual = add_rms_norm(linear_small_m(a, w1, weight_scale=s1), r, nw, eps)
        assert torch.equal(h, residual)
        assert_close(out, normed.double() @ w2.double().T, GEMV_TOL[dtype], f"replay M={m}")


def test_the_fold_is_taken_where_it_measured_faster():
    """By the GPU's name: the H100 SXM (measured faster), not the H200 (slower) nor GPUs never
    measured (other H100s among them)."""
    assert norm_fold_pays("NVIDIA H100 80GB HBM3")
    assert not norm_fold_pays("NVIDIA H200")
    for name in ("NVIDIA H100 NVL", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"):
        assert not norm_fold_pays(name), name


@pytest.mark.gpu
def test_the_fold_takes_16_bit_and_fp8_weights_at_decode_sizes():
    """``fuses_norms``: bf16/fp16/e4m3 weights at 1..16 rows on CUDA, on a GPU where it
    measured faster (none elsewhere); float32 weights and prefill sizes keep the norm's
    kernel."""
    w = torch.empty(8, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.empty(16, 64, device=DEVICE, dtype=torch.bfloat16)
    if not norm_fold_pays(torch.cuda.get_device_name()):
        assert not fuses_norms(x, w) and not fuses_norms(x, w.to(torch.float8_e4m3fn))
        return
    assert fuses_norms(x, w) and fuses_norms(x[:1], w.half())
    assert fuses_norms(x, w.to(torch.float8_e4m3fn))
    assert not fuses_norms(x.float(), w.float())
    assert not fuses_norms(torch.empty(17, 64, device=DEVICE, dtype=torch.bfloat16), w)
    assert not fuses_norms(x.cpu(), w)
