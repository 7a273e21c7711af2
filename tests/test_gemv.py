"""kernels.gemv.linear_small_m against a float64 torch reference (x @ w.T + bias), and with
``act`` (a gated MLP's gate/up projection and activation in one kernel) against
``act(x @ gate.T) * (x @ up.T)`` in float64, for bf16/fp16/fp32 and float8 weights.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets
where there is no GPU) on CPU tensors, at toy sizes, in fp16 and fp32 only: the interpreter
miscomputes tl.dot on bf16 operands and rounds bf16 casts wrongly. With a GPU the same tests run
on it, in bf16 too, plus Llama-3-8B shapes and CUDA-graph replay (``gpu`` marker). Every output
is poisoned with NaN first, so unwritten elements fail the check.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

import torch.nn.functional as F  # noqa: E402
from tensor_checks import (  # noqa: E402
    DEVICE,
    GEMV_DTYPES,
    GEMV_TOL,
    QUANTIZE,
    assert_close,
    capture_graph,
)

from kernels import gemv, quant  # noqa: E402
from kernels import reference as torch_ops  # noqa: E402
from kernels.gemv import MAX_M, gemv_config, linear_act_and_mul, linear_small_m  # noqa: E402


def reference(x, w, bias=None) -> torch.Tensor:
    ref = x.double() @ w.double().T
    return ref + bias.double() if bias is not None else ref


def run(m, n, k, dtype, bias=False, config=None, x_pad=0, out_pad=0, diag=False):
    """linear_small_m on random inputs (x and out with ``*_pad`` extra columns per row)."""
    x = torch.randn(m, k + x_pad, device=DEVICE).to(dtype)[:, :k]
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    out = torch.full((m, n + out_pad), float("nan"), device=DEVICE, dtype=dtype)[:, :n]
    got = linear_small_m(x, w, b, out=out, config=config, diag=diag)
    assert got.data_ptr() == out.data_ptr()
    return got, reference(x, w, b)


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(100, 200), (64, 1024), (17, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, m, n, k, bias):
    out, ref = run(m, n, k, dtype, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, ref, GEMV_TOL[dtype], f"M={m} N={n} K={k} bias={bias}")


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_strided_rows_and_default_out(dtype, m):
    """x and out with padded rows (row stride > K, N); and out=None allocates."""
    out, ref = run(m, 72, 136, dtype, bias=True, x_pad=37, out_pad=5)
    assert_close(out, ref, GEMV_TOL[dtype], "strided")
    x = torch.randn(m, 136 + 8, device=DEVICE).to(dtype)[:, :136]
    w = torch.randn(72, 136, device=DEVICE).to(dtype)
    assert_close(linear_small_m(x, w), reference(x, w), GEMV_TOL[dtype], "out=None")


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): K tails, uneven and capped splits
SPLIT_CONFIGS = [(16, 64, 3, 4, 2), (16, 64, 8, 4, 2), (32, 32, 64, 4, 3), (16, 128, 2, 4, 3)]


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", SPLIT_CONFIGS)
def test_split_k(dtype, m, config):
    """Split-K (the last program of each N tile sums the partials) = the unsplit result."""
    n, k = 40, 300  # K: 5 tiles of 64, 10 of 32, 3 of 128; none divides evenly
    torch.manual_seed(1234 + m)
    out, ref = run(m, n, k, dtype, bias=True, config=config)
    assert_close(out, ref, GEMV_TOL[dtype], f"split {config}")
    torch.manual_seed(1234 + m)
    unsplit, _ = run(m, n, k, dtype, bias=True, config=config[:2] + (1,) + config[3:])
    assert_close(out, unsplit.double(), 2 * GEMV_TOL[dtype], "split vs unsplit")


# diag (x's rows in 8 / M chunks as the dot's columns): one and four warps, K tails, split
DIAG_CONFIGS = [(16, 128, 1, 1, 2), (32, 256, 3, 1, 3), (64, 128, 2, 4, 2)]


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config", DIAG_CONFIGS)
def test_diag_matches_reference(dtype, m, config):
    """``diag`` on a float weight (M = 1 on tl.dot, where it otherwise multiplies
    elementwise): the reference's sums, K with a tail, a bias, padded rows, split or not."""
    out, ref = run(m, 72, 700, dtype, bias=True, config=config, x_pad=5, out_pad=3, diag=True)
    assert_close(out, ref, GEMV_TOL[dtype], f"diag M={m} {config}")


def test_split_counters_left_zero():
    """Every launch leaves the split counters zero (CUDA-graph replays need no memset)."""
    for _ in range(3):
        out, ref = run(2, 50, 256, torch.float32, config=(16, 32, 4, 4, 2))
        assert_close(out, ref, GEMV_TOL[torch.float32], "split repeat")
    assert int(gemv._COUNTERS[out.device].abs().sum()) == 0


def test_heuristic_splits_narrow_layers(monkeypatch):
    """On a 132-SM GPU a 100-row layer gives too few N tiles: the heuristic splits K."""
    monkeypatch.setattr(gemv, "_num_sms", lambda device: 132)
    cfg = gemv_config(1, 100, 4096, 132)
    assert cfg[2] > 1, cfg
    for m in (1, 4):
        out, ref = run(m, 100, 4096, torch.float32)
        assert_close(out, ref, GEMV_TOL[torch.float32], f"heuristic split {cfg} M={m}")


def test_heuristic_configs():
    """Llama-3-8B shapes on an H100: no split, full tiles."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        for m in (1, 8, 16):
            block_n, block_k, split, warps, stages, _ = gemv_config(m, n, k, 132)
            assert split == 1 and k % block_k == 0, (m, n, k)
            assert m == 1 or block_n >= 16


def test_batch_one_takes_long_k_tiles_where_k_pads_little():
    """M = 1: 2048-wide K tiles unless K pads to them by over a tenth (Phi-4's 5120)."""
    assert gemv_config(1, 4096, 14336, 132)[:2] == (4, 2048)
    assert gemv_config(1, 3840, 15360, 132)[:2] == (4, 2048)  # 15360 pads 6.7%
    assert gemv_config(1, 8192, 3840, 132)[:2] == (4, 2048)  # 3840 pads 6.7%
    assert gemv_config(1, 5120, 5120, 132)[:2] == (8, 1024)  # 5120 would pad 20%
    assert gemv_config(1, 100, 4096, 132)[0] == 4  # narrow layers keep their own tiles


def test_batch_one_takes_short_tiles_for_few_rows_of_short_k():
    """M = 1, at most 4,096 rows of K up to 8,192 (a tensor-parallel rank's layers, o_proj):
    (8, 512) tiles, unsplit; more rows or a longer K keep the tiles above."""
    for n, k in [(3072, 4096), (4096, 2048), (4096, 7168), (4096, 4096), (3840, 4096)]:
        assert gemv_config(1, n, k, 132)[:3] == (8, 512, 1), (n, k)
    assert gemv_config(1, 6144, 4096, 132)[:2] == (4, 2048)  # qkv: more rows
    assert gemv_config(1, 4096, 14336, 132)[:2] == (4, 2048)  # down: a longer K
    assert gemv_config(1, 4096, 4096, 132, 1)[:2] != (8, 512)  # fp8 keeps its own rule
    assert gemv_config(8, 4096, 4096, 132)[:2] != (8, 512)  # so do larger M


# ---------------------------------------------------------------- errors


def test_errors():
    dev = DEVICE
    w = torch.randn(8, 32, device=dev)
    x = lambda m, k=32: torch.randn(m, k, device=dev)  # noqa: E731
    half = torch.float16
    bad = {  # what: (x, weight, bias, out, config)
        "M=0": (x(0), w, None, None, None),
        f"M={MAX_M + 1}": (x(MAX_M + 1), w, None, None, None),
        "K mismatch": (x(2, 31), w, None, None, None),
        "x 3-D": (x(2)[None], w, None, None, None),
        "dtype mismatch": (x(2).to(half), w, None, None, None),
        "int dtype": (x(2).int(), w.int(), None, None, None),
        "weight transposed": (x(2, 8), torch.randn(8, 8, device=dev).T, None, None, None),
        "x K-strided": (x(2, 64)[:, ::2], w, None, None, None),
        "empty weight": (x(2), w[:0], None, None, None),
        "bias shape": (x(2), w, torch.randn(9, device=dev), None, None),
        "bias dtype": (x(2), w, torch.randn(8, device=dev).to(half), None, None),
        "out shape": (x(2), w, None, torch.empty(2, 9, device=dev), None),
        "out dtype": (x(2), w, None, torch.empty(2, 8, device=dev, dtype=half), None),
        "M>1 with BLOCK_N 8": (x(2), w, None, None, (8, 32, 1, 4, 2)),
        "BLOCK_K 48": (x(1), w, None, None, (16, 48, 1, 4, 2)),
        "SPLIT_K 0": (x(1), w, None, None, (16, 32, 0, 4, 2)),
    }
    for what, (xt, wt, b, out, config) in bad.items():
        with pytest.raises(ValueError):
            linear_small_m(xt, wt, b, out=out, config=config)
            pytest.fail(f"no ValueError for {what}")
    assert linear_small_m(x(1), w).shape == (1, 8)


# ---------------------------------------------------------------- GPU: real shapes, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1024, 4096), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_llama_shapes_bf16(n, k, m):
    """Llama-3-8B shapes in bf16, heuristic configs (N=1024 at M > 1 splits K on an H100)."""
    out, ref = run(m, n, k, torch.bfloat16, bias=True)
    assert_close(out, ref, GEMV_TOL[torch.bfloat16], f"bf16 M={m} N={n} K={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(16, 256, 1, 1, 6), (32, 128, 4, 1, 6), (64, 256, 1, 4, 3)])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_diag_llama_shapes_bf16(config, m):
    """``diag`` in bf16 at Llama-3-8B's o_proj and down shapes (the tiles ``kernels.bench_gemv
    --diag`` times; their layouts exist only on the GPU)."""
    for n, k in [(4096, 4096), (4096, 14336)]:
        out, ref = run(m, n, k, torch.bfloat16, bias=True, config=config, diag=True)
        assert_close(out, ref, GEMV_TOL[torch.bfloat16], f"bf16 diag M={m} N={n} K={k} {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (32, 256, 4, 4, 4), (16, 512, 3, 4, 3)])
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay(config, m):
    """One capture; replays with new x give fresh, correct results (split counters reset)."""
    n, k, dtype = 2048, 4096, torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    graph, (out, out2) = capture_graph(  # back to back: counters reused
        lambda: (linear_small_m(x, w, b, config=config), linear_small_m(x, w, b, config=config))
    )
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(x, w, b)
        assert_close(out, ref, GEMV_TOL[dtype], f"graph replay {config}")
        assert torch.equal(out, out2)  # the same sum order whichever program finishes last


# ---------------------------------------------------------------- gated: act(gate) * up

ACTS = ["silu", "gelu_tanh"]


def gated_reference(x, w, act, bias=None) -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)`` in float64, w = [gate; up] [2I, K] (float64 too)."""
    gate, up = reference(x, w, bias).chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def run_gated(m, inter, k, dtype, act, bias=False, config=None, scales=None, out_pad=0):
    """linear_small_m(act=...) on random inputs: a float weight of ``dtype``, or (``scales``)
    an e4m3 one; returns (out, float64 reference)."""
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = torch.randn(2 * inter, k, device=DEVICE) / k**0.5 * 2  # gate sums of ~N(0, 4)
    scale = None
    if scales:
        w, scale = QUANTIZE[scales](w)
        w_ref = quant.dequantize(w, scale, torch.float64)
    else:
        w = w_ref = w.to(dtype)
    b = torch.randn(2 * inter, device=DEVICE).to(dtype) if bias else None
    out = torch.full((m, inter + out_pad), float("nan"), device=DEVICE, dtype=dtype)[:, :inter]
    got = linear_small_m(x, w, b, out=out, weight_scale=scale, config=config, act=act)
    assert got.data_ptr() == out.data_ptr() and got.shape == (m, inter)
    return got, gated_reference(x, w_ref, act, b)


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("inter,k", [(37, 300), (64, 1024), (5, 48)])
def test_gated_matches_reference(dtype, act, inter, k):
    """M = 1..8, the heuristic's tiles (M = 1: the FMA loop; M > 1: tl.dot), odd I and K."""
    for m in range(1, 9):
        out, ref = run_gated(m, inter, k, dtype, act, bias=m % 2 == 0, out_pad=3)
        assert_close(out, ref, GEMV_TOL[dtype], f"{act} M={m} I={inter} K={k}")


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): M = 1's FMA tiles (2 and 4 gate rows a
# program), tl.dot tiles, K tails, split K (the activation after the last program's sum)
GATED_CONFIGS = [(4, 64, 1, 4, 2), (8, 128, 3, 4, 2), (16, 64, 3, 4, 2), (32, 32, 64, 4, 3),
                 (64, 128, 2, 4, 3)]  # fmt: skip


@pytest.mark.parametrize("config", GATED_CONFIGS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gated_configs_and_split_k(config, act, m):
    if m > 1 and config[0] < 16:
        pytest.skip("tl.dot tiles have BLOCK_N >= 16")
    inter, k = 45, 333  # tiles past I; K: 6 tiles of 64, 11 of 32, 3 of 128, none even
    torch.manual_seed(77 + m)
    out, ref = run_gated(m, inter, k, torch.float32, act, bias=True, config=config)
    assert_close(out, ref, GEMV_TOL[torch.float32], f"{act} M={m} {config}")
    torch.manual_seed(77 + m)
    unsplit, _ = run_gated(m, inter, k, torch.float32, act, bias=True,
                           config=config[:2] + (1,) + config[3:])  # fmt: skip
    assert_close(out, unsplit.double(), 2 * GEMV_TOL[torch.float32], "split vs unsplit")
    counters = gemv._COUNTERS.get(out.device)  # made by the first split launch
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("inter,k", [(37, 300), (192, 260)])
def test_gated_fp8(scales, act, inter, k):
    """e4m3 weights, M = 1..8, fp16 x, the heuristic's tiles. Block scales: I = 192 starts the
    up rows half a block in (a tile's gate rows read one block row, its up rows another);
    I = 37 (gate and up rows in one block, not a multiple of BLOCK_N / 2) is refused."""
    for m in range(1, 9):
        if scales == "block" and inter % 32:
            with pytest.raises(ValueError, match="multiple of BLOCK_N"):
                run_gated(m, inter, k, torch.float16, act, scales=scales)
            continue
        out, ref = run_gated(m, inter, k, torch.float16, act, scales=scales)
        assert_close(out, ref, GEMV_TOL[torch.float16], f"{scales} {act} M={m} I={inter}")


def test_gated_block_scales_off_the_tiles_take_two_steps(monkeypatch):
    """linear_act_and_mul where the fused kernel would stream (``_streams``) but block scales
    meet an I that is not a multiple of 64: the GEMV, then the activation kernel; right."""
    monkeypatch.setattr(gemv, "_streams", lambda x, weight: True)
    x = torch.randn(2, 300, device=DEVICE).half()
    for inter in (37, 96, 128):
        w, scale = quant.quantize_blocks(torch.randn(2 * inter, 300, device=DEVICE) / 10)
        assert gemv._fuses(x, w, scale) == (inter % 64 == 0), inter
        got = linear_act_and_mul(x, w, None, scale, "silu")
        ref = gated_reference(x, quant.dequantize(w, scale, torch.float64), "silu")
        assert_close(got, ref, GEMV_TOL[torch.float16], f"block scales I={inter}")


@pytest.mark.parametrize("config", [(16, 64, 3, 4, 2), (32, 256, 2, 4, 2), (64, 128, 1, 4, 2)])
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 5])
def test_gated_fp8_configs_and_split_k(config, scales, m):
    """fp8 tiles unsplit and split (per-channel scales and the activation after the sum);
    block scales at an I that is a multiple of each tile's BLOCK_N / 2."""
    inter = 100 if scales == "channel" else 96
    out, ref = run_gated(m, inter, 700, torch.float16, "gelu_tanh", bias=True, config=config,
                         scales=scales)  # fmt: skip
    assert_close(out, ref, GEMV_TOL[torch.float16], f"{scales} {config} M={m}")


def test_gated_errors():
    x, w = torch.randn(2, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)
    bad = {
        "odd rows": dict(weight=w[:7], act="silu"),
        "unknown act": dict(weight=w, act="relu"),
        "out of 2I columns": dict(weight=w, act="silu", out=torch.empty(2, 8, device=DEVICE)),
        "BLOCK_N 1": dict(weight=w, act="silu", config=(1, 32, 1, 4, 2), x=x[:1]),
    }
    for what, kw in bad.items():
        with pytest.raises(ValueError):
            linear_small_m(kw.pop("x", x), **kw)
            pytest.fail(f"no ValueError for {what}")
    with pytest.raises(ValueError, match="act"):
        linear_act_and_mul(x, w, act="relu")


@pytest.mark.parametrize("act", ACTS)
def test_linear_act_and_mul_chooses_one_path(monkeypatch, act):
    """The Triton backend's op: where ``linear`` streams the weight (``_streams``: CUDA, M <=
    16) the fused kernel alone, else ``linear`` then the activation kernel; both near the
    float64 reference, the second equal to those two calls."""
    x = torch.randn(3, 96, device=DEVICE, dtype=torch.float16)
    w = (torch.randn(80, 96, device=DEVICE) / 5).half()
    ref = gated_reference(x, w.double(), act)
    launches = []

    def recorded(name, kernel):  # the activation kernel, noting its launches
        return lambda t, chain=True: launches.append(name) or kernel(t, chain=chain)

    act_kernels = {name: recorded(name, fn) for name, fn in gemv._ACT_AND_MUL.items()}
    monkeypatch.setattr(gemv, "_ACT_AND_MUL", act_kernels)
    monkeypatch.setattr(gemv, "_streams", lambda x, weight: False)
    two_step = linear_act_and_mul(x, w, act=act)
    assert launches == [act]
    want = gemv._ACT_AND_MUL[act](gemv.linear(x, w))
    assert torch.equal(two_step, want)
    assert_close(two_step, ref, GEMV_TOL[torch.float16], f"{act} two steps")
    monkeypatch.setattr(gemv, "_streams", lambda x, weight: True)
    fused = linear_act_and_mul(x, w, act=act)
    assert launches == [act, act]  # the check above; none here
    assert_close(fused, ref, GEMV_TOL[torch.float16], f"{act} fused")
    assert_close(fused, torch_ops.linear_act_and_mul(x, w, None, None, act).double(),
                 GEMV_TOL[torch.float16], "against the torch backend's op")  # fmt: skip


# Gemma 3 12B and Llama 3 8B gate_up ([2I, K]), bf16, the heuristic's tiles on the GPU
GATED_SHAPES = {"gemma3-12b": (15360, 3840), "llama3-8b": (14336, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GATED_SHAPES))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("scales", [None, "channel", "block"])
def test_gated_model_shapes_bf16(shape, act, m, scales):
    inter, k = GATED_SHAPES[shape]
    out, ref = run_gated(m, inter, k, torch.bfloat16, act, scales=scales)
    assert_close(out, ref, GEMV_TOL[torch.bfloat16], f"{shape} {act} {scales} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (16, 512, 4, 4, 3), (64, 256, 3, 4, 3)])
@pytest.mark.parametrize("m", [1, 8])
def test_gated_cuda_graph_replay(config, m):
    """Captured fused calls replay with new x, split ones too (counters left zero), and
    match the unfused two steps within bf16 rounding."""
    if m > 1 and config and config[0] < 16:
        pytest.skip("tl.dot tiles have BLOCK_N >= 16")
    inter, k, dt = 2048, 4096, torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = (torch.randn(2 * inter, k, device="cuda") / 32).to(dt)
    graph, out = capture_graph(lambda: linear_small_m(x, w, config=config, act="gelu_tanh"))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = gated_reference(x, w.double(), "gelu_tanh")
        assert_close(out, ref, GEMV_TOL[dt], f"graph replay {config}")
        unfused = torch_ops.gelu_tanh_and_mul(linear_small_m(x, w, config=config))
        assert_close(out, unfused.double(), 2 * GEMV_TOL[dt], "fused vs unfused")


def test_diag_tiles_of_the_heuristic():
    """``gemv_config`` takes diag at M = 2-8 on a float weight (one-warp tiles it takes: BLOCK_N
    >= 16, BLOCK_K >= 128 dividing K), never at M = 1 or over 8; and ``linear_small_m`` runs
    it by default there (the same sums as without)."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (100, 4096)]:
        for m in (1, 2, 8, 9, 16):
            block_n, block_k, split, warps, _, diag = gemv_config(m, n, k, 132)
            assert diag == (2 <= m <= 8), (m, n, k)
            if diag:
                assert block_n >= 16 and block_k >= 128 and k % block_k == 0 and warps == 1
                assert split == 1 or n == 100, (m, n, k, split)
    assert gemv_config(8, 6144, 4096, 132)[0] == 16 and gemv_config(8, 4096, 4096, 132)[0] == 32
    for m in (3, 8):
        x = torch.randn(m, 700, device=DEVICE, dtype=torch.float32)
        w = torch.randn(72, 700, device=DEVICE, dtype=torch.float32)
        want = linear_small_m(x, w, config=gemv_config(m, 72, 700, 4)[:5], diag=False)
        got = linear_small_m(x, w)
        assert_close(got, x.double() @ w.double().T, GEMV_TOL[torch.float32], f"default M={m}")
        assert_close(got, want.double(), GEMV_TOL[torch.float32], f"diag vs not M={m}")


def _triton_kind(value):
    """What Triton keys a run-time argument by: a tensor's dtype, an integer's kind (1, a
    multiple of 16, other), anything else's value (constexprs: their values)."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, int) and not isinstance(value, bool):
        return 1 if value == 1 else ("x16" if value % 16 == 0 else "int")
    return value


@pytest.mark.parametrize("weight", ["16-bit", "fp8 channel", "fp8 block"])
@pytest.mark.parametrize("n,k,act", [(6144, 4096, None), (4096, 14336, None), (1024, 4096, None),
                                     (28672, 4096, "silu")])  # fmt: skip
def test_rows_compiled_apart_meet_every_compile(monkeypatch, weight, n, k, act):
    """``rows_compiled_apart``: the launches at its row counts carry every argument kind and
    constexpr that the launches at 1 <= M <= MAX_M carry (Llama-3-8B's projections on a
    132-SM GPU, and a narrow one that splits K), so a warm-up running them leaves no compile
    for later; and no two of them carry the same."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                consts = {k: str(v.dtype) if torch.is_tensor(v) else v for k, v in kwargs.items()}
                launches.append((tuple(map(_triton_kind, args)), tuple(sorted(consts.items()))))

            return launch

    monkeypatch.setattr(gemv, "_linear_kernel", Recorder())
    monkeypatch.setattr(gemv, "_num_sms", lambda device: 132)
    w = torch.empty(n, k, dtype=torch.float16)
    scale = None
    if weight == "fp8 channel":
        w, scale = w.to(torch.float8_e4m3fn), torch.ones(n)
    elif weight == "fp8 block":
        w, scale = w.to(torch.float8_e4m3fn), torch.ones(triton.cdiv(n, 128), triton.cdiv(k, 128))

    def keys(rows):
        launches.clear()
        for m in rows:
            linear_small_m(torch.zeros(m, k, dtype=torch.float16), w, weight_scale=scale, act=act)
        return list(launches)

    apart = gemv.rows_compiled_apart()
    assert apart[0] == 1 and apart[-1] == MAX_M and list(apart) == sorted(set(apart))
    assert set(keys(range(1, MAX_M + 1))) == set(keys(apart))
    assert len(set(keys(apart))) == len(apart)
