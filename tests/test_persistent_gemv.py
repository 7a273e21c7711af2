"""The persistent decode layer of docs/benchmarks/persistent_gemv.py (one launch: qkv ->
o_proj + residual -> gate_up + silu(gate) * up -> down + residual, grid barriers between)
against its float64 reference, with e4m3 weights whose rows have scales of different sizes
(so that a scale on the wrong row shows) and fp16 activations.

Without a GPU the kernel runs in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1),
which runs the programs one after another: a grid barrier completes there only with one
program, so the tests take ``programs=1`` (the interpreter's tl.dot is wrong on bf16: fp16
only). The split of the tiles over several programs is checked through the barrier's timeout
(``test_work_split_over_programs``). Every output is compared as the kernel stores it: each
intermediate rounded to fp16 before the next GEMV reads it, in the reference too.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

import bench_scripts  # noqa: E402
from tensor_checks import DEVICE, GEMV_TOL, assert_close  # noqa: E402

from kernels.quant import quantize_per_channel  # noqa: E402

pg = bench_scripts.load("persistent_gemv")
DT = torch.float16
NAMES = ("qkv", "r1", "h", "out")
# (H, I, NQ) and the tile. NQ a multiple of no tile's rows (the last tile moved back over the
# one before it); K steps a tile (H / block_k, I / block_k) of 1-3: prefetch_steps equal to
# them (the first tile whole before the loop) and under; the rows of a tile in 4, 2 or 1
# dots (groups; 1: one dot over all rows).
CASES = {
    "h128-bn16-g4": ((128, 256, 152), dict(block_n=16, block_k=128, num_stages=2,
                                           prefetch_steps=1, groups=4)),
    "h256-bn32-g2": ((256, 384, 328), dict(block_n=32, block_k=128, num_stages=3,
                                           prefetch_steps=1, groups=2)),
    "h128-bn8-g1": ((128, 256, 136), dict(block_n=8, block_k=128, num_stages=2,
                                          prefetch_steps=1, groups=1)),
    # two-level barriers (groups of one program here: the group's last arrival counts it)
    "h128-bn8-g1-sync4": ((128, 256, 136), dict(block_n=8, block_k=128, num_stages=2,
                                                prefetch_steps=1, groups=1, balance=10,
                                                sync_groups=4)),
}  # fmt: skip


def _layer(h: int, i: int, nq: int) -> list[torch.Tensor]:
    """x [H] and the layer's weights in ``layer_chain``'s order: e4m3 codes, their scales
    times 1/4..4 by row and 1/sqrt(K) (outputs O(1))."""
    args = [torch.randn(h, device=DEVICE).to(DT)]
    for n, k in ((nq, h), (h, h), (2 * i, h), (h, i)):
        q, s = quantize_per_channel(torch.randn(n, k, device=DEVICE))
        spread = (torch.rand(n, device=DEVICE) * 4 - 2).exp2()
        args += [q, s * spread / k**0.5]
    return args


def _check(got, args, what: str) -> None:
    ref = pg.reference(*args, dtype=DT)
    for name, out, want in zip(NAMES, got, ref, strict=True):
        assert out.dtype == DT and out.shape == want.shape, (what, name, out.shape)
        assert_close(out, want, GEMV_TOL[DT], f"{what} {name}")


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, prefetch):
    """One program, each phase's tiles in turn; and each launch moves every barrier count
    and the epoch on by one (the counters are never reset), and with two-level barriers its
    group's counts too."""
    shape, tiles = CASES[case]
    args = _layer(*shape)
    groups = tiles.get("sync_groups", 1)
    key = (torch.device(DEVICE), 1, groups)
    before = pg._SYNC[key].tolist() if key in pg._SYNC else [0] * (4 + 3 * groups)
    got = pg.layer_chain(*args, programs=1, prefetch=prefetch, **tiles)
    _check(got, args, f"{case} prefetch={prefetch}")
    # the three barriers and the epoch; with groups, group 0's three counts (its one program)
    step = [1] * 4 + [int(groups > 1)] * 3 + [0] * (3 * groups - 3)
    assert pg._SYNC[key].tolist() == [b + d for b, d in zip(before, step, strict=True)]
    assert pg.barrier_timeouts(DEVICE) == 0


def test_work_split_over_programs():
    """Nine programs: uneven shares of each phase's tiles, and none of o_proj's and down's 8
    tiles for one of them. In the interpreter a barrier never completes (programs run one
    after another): each wait times out (counted) and the phase reads what the launch before
    left. Four launches into the same outputs: the k-th computes phase k from complete
    inputs, so the fourth's outputs are all right if the shares cover every tile. On a GPU
    the barriers complete and no wait times out."""
    shape, tiles = CASES["h128-bn16-g4"]
    args = _layer(*shape)
    h, i, nq = shape
    out = tuple(torch.full((n,), float("nan"), dtype=DT, device=DEVICE) for n in (nq, h, i, h))
    for _ in range(4):
        pg.layer_chain(*args, programs=9, out=out, spin_limit=10, **tiles)
    timeouts = pg.barrier_timeouts(DEVICE)
    pg.reset_barriers(DEVICE)
    _check(out, args, "9 programs")
    interpreted = DEVICE == "cpu"
    assert (timeouts > 0) if interpreted else (timeouts == 0), timeouts


@pytest.mark.parametrize(
    "outputs,gated,programs,block_n,balance,want",
    [
        (6144, False, 528, 8, 10, 4),  # Llama-3-8B's qkv: 768 8-row tiles, 8 or 4 an SM
        (6144, False, 528, 8, 0, 8),  # balance off: block_n
        (14336, True, 528, 8, 10, 8),  # gate_up: 3584 tiles, 27 or 28 an SM
        (14336, True, 528, 16, 10, 8),  # 1792 16-row tiles: 12 or 16 an SM
        (4096, False, 528, 16, 10, 8),  # o_proj, down: 512 8-row tiles, 3 or 4 an SM
        (4096, False, 132, 16, 10, 16),  # 256 tiles on 132 programs: 1 or 2 an SM ...
        (4096, False, 132, 16, 100, 16),  # ... balanced enough at 100%
        (6144, False, 528, 8, 1, 4),  # never under min_rows (4)
    ],
)
def test_phase_rows(outputs, gated, programs, block_n, balance, want):
    """A phase's rows a tile: halved while the busiest SM has over (100 + balance)% of the
    mean's tiles; min_rows is the floor."""
    tiles = pg.ChainTiles(block_n=block_n, block_k=256, num_warps=1, groups=1, balance=balance)
    assert pg.phase_rows(outputs, gated, programs, 132, tiles) == want


def _bad(args: list, what: str) -> list:
    """A copy of ``args`` with one operand broken (``what``)."""
    args = list(args)
    x, w_qkv, s_qkv, w_o, s_o, w_gu, s_gu, w_d, s_d = range(9)
    if what == "x 2-D":
        args[x] = args[x][None, :]
    elif what == "x fp32":
        args[x] = args[x].float()
    elif what == "w_o shape":
        args[w_o] = args[w_o][:, :-8].contiguous()
    elif what == "w_qkv fp16":
        args[w_qkv] = args[w_qkv].to(DT)
    elif what == "s_gu fp16":
        args[s_gu] = args[s_gu].to(DT)
    elif what == "s_d shape":
        args[s_d] = args[s_d][:-1]
    elif what == "qkv rows < H":
        args[w_qkv], args[s_qkv] = args[w_qkv][:64].contiguous(), args[s_qkv][:64]
    elif what == "w_gu odd":
        args[w_gu], args[s_gu] = args[w_gu][:-1].contiguous(), args[s_gu][:-1]
    return args


@pytest.mark.parametrize(
    "what,kwargs,match",
    [
        ("x 2-D", {}, "x must be"),
        ("x fp32", {}, "x must be"),
        ("w_o shape", {}, "w_o must be"),
        ("w_qkv fp16", {}, "w_qkv must be"),
        ("s_gu fp16", {}, "w_gu's scales"),
        ("s_d shape", {}, "w_d's scales"),
        ("qkv rows < H", {}, "fewer than o_proj reads"),
        ("w_gu odd", {}, "w_gu must be"),
        (None, {"block_k": 256}, "multiples of block_k"),
        (None, {"block_k": 64}, "powers of two"),
        (None, {"prefetch_steps": 2}, "prefetch_steps"),
        (None, {"programs": 0}, "programs must be"),
        (None, {"out": (torch.empty(3),)}, "out must be"),
    ],
)
def test_refuses_bad_operands(what, kwargs, match):
    """Shapes, dtypes and tiles the kernel does not take: a ValueError that says which."""
    shape, tiles = CASES["h128-bn16-g4"]
    args = _bad(_layer(*shape), what) if what else _layer(*shape)
    with pytest.raises(ValueError, match=match):
        pg.layer_chain(*args, **{"programs": 1, **tiles, **kwargs})
