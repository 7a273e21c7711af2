"""The all-reduce of two ranks folded into the row-parallel GEMV and the norm after it
(``kernels.fold``), two ranks emulated in one process: each rank's slots, counter and status
are ordinary tensors, the peer's "mapped" ones simply the other rank's. A call runs
rank 0's GEMV, rank 1's GEMV, rank 0's norm, rank 1's norm, as a GPU pair may; over calls
k = 0..4 both slots are written twice.

Without a GPU the kernels run in Triton's interpreter (fp32 and fp16: its bf16 ``tl.dot`` is
wrong), which runs one program at a time and cannot show a norm spinning while the peer
works: what a norm would wait for is checked through the spin limit instead (it gives up and
reports the tag it waited for). With a GPU, in bf16 too, on one device (the words' semantics
are the same; tests/test_tp_fold_gpu.py runs two).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import assert_close  # noqa: E402

from kernels.fold import UNIT, AllReduceFold, call_tag  # noqa: E402
from kernels.gemv import linear_small_m  # noqa: E402
from kernels.norm import add_rms_norm, norm_add_norm  # noqa: E402
from kernels.quant import quantize_per_channel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def words_values(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of int64 words (their low 32 bits) as ``dtype``."""
    low = (words & 0xFFFFFFFF).to(torch.int64)
    if dtype == torch.float32:
        return low.to(torch.int32).view(torch.float32)
    return low.to(torch.int16).view(dtype)


def words_tags(words: torch.Tensor) -> torch.Tensor:
    """The tags of int64 words (their high 32 bits)."""
    return words >> 32


def fold_pair(rows: int, hidden: int, dtype: torch.dtype, spin_limit: int = 1 << 20):
    """Rank 0's and rank 1's halves of one folded all-reduce, in one process."""
    z = lambda: torch.zeros(1, dtype=torch.int64, device=DEVICE)
    # words of tag 0 (no call's) around a NaN's bits, as a fresh buffer might hold garbage
    nan = torch.tensor(float("nan"), dtype=dtype)
    bits = nan.view(torch.int32 if dtype == torch.float32 else torch.int16).item()
    recv = [torch.full((2, rows, hidden), bits & 0xFFFFFFFF, dtype=torch.int64, device=DEVICE)
            for _ in range(2)]  # fmt: skip
    calls, status = [z(), z()], [z(), z()]
    return [AllReduceFold(send=recv[1 - r], recv=recv[r], dtype=dtype, calls=calls[r],
                          status=status[r], spin_limit=spin_limit)
            for r in range(2)]  # fmt: skip


def rms_ref(x: torch.Tensor, w: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * (1.0 + w) if unit_offset else x * w


def one_call(folds, m, n, k, dtype, config=None, post=False, fp8=False):
    """Both ranks' GEMV and norm of one call; (each rank's (normed, residual), the float64
    reference of both, the unfolded kernels' results, the GEMV outputs)."""
    x = [torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2)]
    w = [(torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype) for _ in range(2)]
    scales = [None, None]
    if fp8:
        w, scales = zip(*(quantize_per_channel(wi.float()) for wi in w), strict=True)
    res = torch.randn(m, n, device=DEVICE).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    post_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype) if post else None
    outs = [linear_small_m(x[r], w[r], weight_scale=scales[r], config=config, fold=folds[r])
            for r in range(2)]  # fmt: skip
    if post:
        got = [norm_add_norm(outs[r], res, post_w, norm_w, EPS, True, fold=folds[r])
               for r in range(2)]  # fmt: skip
    else:
        got = [add_rms_norm(outs[r], res, norm_w, EPS, fold=folds[r]) for r in range(2)]
    # float64: (x0 @ W0^T + x1 @ W1^T) + residual, normed
    wd = [w[r].double() * (scales[r].double()[:, None] if fp8 else 1.0) for r in range(2)]
    s = sum(x[r].double() @ wd[r].T for r in range(2))
    if post:
        s = rms_ref(s, post_w.double(), True)
    ref_res = res.double() + s
    ref = rms_ref(ref_res, norm_w.double(), post)
    # what an all-reduce (the GEMVs' outputs summed in float32, rounded) and the unfolded
    # kernel give: the folded path must be that, bit for bit
    summed = (outs[0].float() + outs[1].float()).to(dtype)
    if post:
        unfolded = norm_add_norm(summed, res, post_w, norm_w, EPS, True)
    else:
        unfolded = add_rms_norm(summed, res, norm_w, EPS)
    return got, (ref, ref_res), unfolded, outs


def check_call(folds, call, got, want, unfolded, outs, dtype):
    ref, ref_res = want
    for r in range(2):
        normed, residual = got[r]
        where = f"call {call}, rank {r}"
        assert torch.equal(normed, unfolded[0]), f"{where}: normed differs from the unfolded"
        assert torch.equal(residual, unfolded[1]), f"{where}: residual differs from unfolded"
        assert_close(residual, ref_res, TOL[dtype], f"{where}: residual")
        assert_close(normed, ref, 2 * TOL[dtype], f"{where}: normed")
        # the peer's slot of this call holds this rank's GEMV output, tagged with the call;
        # the counters advanced by one call each
        slot = folds[1 - r].recv[call % 2, : outs[r].shape[0]]
        assert torch.equal(words_values(slot, dtype), outs[r]), f"{where}: slot {call % 2}"
        assert (words_tags(slot) == call + 1).all(), f"{where}: tags of slot {call % 2}"
        assert folds[r].calls.item() == (call + 1) * UNIT, where
        assert folds[r].failed() == 0, where


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 72, 40), (3, 64, 96), (16, 100, 56), (5, 17, 33)])
def test_two_ranks_sum_and_norm_over_calls_that_reuse_both_slots(dtype, m, n, k):
    """Llama's form (add_rms_norm), calls k = 0..4, odd sizes: each rank's norm gives the
    float64 reference of (x0 W0^T + x1 W1^T) + residual, normed, and exactly what an
    all-reduce followed by the unfolded kernel gives."""
    folds = fold_pair(16, n, dtype)
    for call in range(5):
        got, want, unfolded, outs = one_call(folds, m, n, k, dtype)
        check_call(folds, call, got, want, unfolded, outs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_s_output_norm_applies_to_the_sum(dtype):
    """norm_add_norm (Gemma's post-norm, the residual add, the next norm, ``1 + w``): the
    post-norm of the two ranks' sum, not of either partial."""
    folds = fold_pair(16, 48, dtype)
    for call in range(5):
        got, want, unfolded, outs = one_call(folds, 4, 48, 40, dtype, post=True)
        check_call(folds, call, got, want, unfolded, outs, dtype)


@pytest.mark.parametrize("m", [1, 6])
def test_split_k_and_calls_of_different_grids(m):
    """Split K (the last program of a tile stores its words) and calls whose grids differ
    (o_proj-like and down_proj-like, other tiles): every word of each call tagged with it."""
    dtype = torch.float32
    folds = fold_pair(16, 40, dtype)
    configs = [(16, 16, 3, 4, 1), (16, 32, 1, 4, 1), (32, 16, 4, 4, 1), None, (16, 16, 2, 4, 1)]
    for call, config in enumerate(configs):
        k = 48 if call % 2 else 64  # down_proj's K is another than o_proj's
        got, want, unfolded, outs = one_call(folds, m, 40, k, dtype, config=config)
        check_call(folds, call, got, want, unfolded, outs, dtype)


def test_fp8_weights_fold_alike():
    """A float8 weight with per-channel scales: the scaled output is what is sent."""
    dtype = torch.float16
    folds = fold_pair(16, 64, dtype)
    for call in range(3):
        got, want, unfolded, outs = one_call(folds, 2, 64, 128, dtype, fp8=True)
        check_call(folds, call, got, want, unfolded, outs, dtype)


def test_a_norm_waits_for_every_word_of_the_peer_s_call():
    """What a norm waits for: every word of its row tagged with call k. With the peer's GEMV
    of call 2 not begun (the slot still holds call 0's words) or one word short, the norm
    spins to its limit and reports that tag; with all there, it reports nothing and adds
    the values. The counter advances one call either way."""
    dtype = torch.float32
    folds = fold_pair(16, 32, dtype, spin_limit=3)
    f0 = folds[0]
    x = torch.randn(2, 32, device=DEVICE)
    res = torch.randn(2, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    peer = torch.randn(2, 32, device=DEVICE)
    bits = peer.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert call_tag(2 * UNIT) == 3
    stale = bits | (1 << 32)  # call 0's tag, in slot 2 % 2
    short = (bits | (3 << 32)).clone()
    short[1, 31] = stale[1, 31]  # the last word of the second row not yet there
    for words, bad_rows in ((stale, 2), (short, 1)):
        f0.calls.fill_(2 * UNIT)
        f0.status.zero_()
        f0.recv[0, :2] = words
        add_rms_norm(x, res, w, EPS, fold=f0)
        assert f0.failed() == 3, bad_rows
        assert f0.calls.item() == 3 * UNIT
    f0.calls.fill_(2 * UNIT)
    f0.status.zero_()
    f0.recv[0, :2] = bits | (3 << 32)
    f0.recv[1, :2] = 0  # the other slot: read, but its words are dropped
    normed, residual = add_rms_norm(x, res, w, EPS, fold=f0)
    assert f0.failed() == 0 and f0.calls.item() == 3 * UNIT
    assert torch.equal(residual, res + (x + peer))


def test_the_gemv_takes_the_slot_and_tag_of_its_call():
    """The GEMV of call k writes slot k % 2 of the peer's buffer with tag k + 1, the other
    slot untouched; only the norm advances the counter."""
    folds = fold_pair(16, 24, torch.float32)
    f0, f1 = folds
    x = torch.randn(3, 16, device=DEVICE)
    w = torch.randn(24, 16, device=DEVICE)
    for call in (0, 1, 2):
        f0.calls.fill_(call * UNIT)
        before = f1.recv[(call + 1) % 2].clone()
        out = linear_small_m(x, w, fold=f0)
        assert torch.equal(words_values(f1.recv[call % 2, :3], torch.float32), out)
        assert (words_tags(f1.recv[call % 2, :3]) == call + 1).all()
        assert torch.equal(f1.recv[(call + 1) % 2], before)
        assert f0.calls.item() == call * UNIT


def test_tags_wrap_without_zero():
    """The tag is k mod (2^31 - 1) + 1: never 0 (a zeroed slot's), and calls k and k + 2 (one
    slot's consecutive users) never share one."""
    from kernels.fold import TAG_MOD

    for k in (0, 1, TAG_MOD - 2, TAG_MOD - 1, TAG_MOD, 5 * TAG_MOD + 3, (1 << 39) - 3):
        t, t2 = call_tag(k * UNIT), call_tag((k + 2) * UNIT)
        assert 1 <= t <= TAG_MOD and t != t2, k


def test_what_does_not_fit_the_slots_is_refused():
    folds = fold_pair(4, 32, torch.float32)
    x = torch.randn(5, 16, device=DEVICE)
    w = torch.randn(32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit the folded all-reduce's slots"):
        linear_small_m(x, w, fold=folds[0])  # 5 rows, slots of 4
    with pytest.raises(ValueError, match="does not fit"):
        linear_small_m(x[:2], torch.randn(48, 16, device=DEVICE), fold=folds[0])  # 48 columns
    with pytest.raises(ValueError, match="does not fit"):
        add_rms_norm(x[:2].half(), x[:2].half(), torch.ones(16).half(), EPS, fold=folds[0])
    with pytest.raises(ValueError, match="not a gated one"):
        linear_small_m(x[:2], torch.randn(64, 16, device=DEVICE), act="silu", fold=folds[0])
    with pytest.raises(ValueError, match="must be one int64"):
        AllReduceFold(folds[0].send, folds[0].recv, torch.float32, folds[0].calls.int(),
                      folds[0].status)  # fmt: skip
    with pytest.raises(ValueError, match="int64 words"):
        AllReduceFold(folds[0].send.float(), folds[0].recv.float(), torch.float32,
                      folds[0].calls, folds[0].status)  # fmt: skip
    with pytest.raises(ValueError, match="must be one of"):
        AllReduceFold(folds[0].send, folds[0].recv, torch.float64, folds[0].calls,
                      folds[0].status)  # fmt: skip


def test_the_engine_s_views_of_the_two_buffers():
    """``parallel._Fused`` (here over two plain byte buffers instead of symmetric memory):
    each slot at a fixed offset whatever the hidden size and dtype (so that a call never
    shares bytes with the one before), the kernels' sums through them."""
    from flashserve.engine.parallel import FOLD_SLOT_BYTES, _Fused

    bufs = [torch.zeros(_Fused.NBYTES, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    fused = [_Fused(bufs[r], bufs[1 - r]) for r in range(2)]
    f32, f16 = fused[0].fold(24, torch.float32), fused[0].fold(40, torch.float16)
    for f in (f32, f16):
        assert f.recv.data_ptr() == bufs[0].data_ptr() and f.recv.dtype == torch.int64
        assert f.recv.stride(0) * 8 == FOLD_SLOT_BYTES and f.recv.shape[1:] == (16, f.hidden)
        assert f.send.data_ptr() == bufs[1].data_ptr()
    assert (f32.dtype, f16.dtype) == (torch.float32, torch.float16)
    assert fused[0].fold(24, torch.float32) is f32  # made once
    assert fused[0].fold(16384, torch.bfloat16).hidden == 16384  # a 405B's rows fit
    with pytest.raises(ValueError, match="do not fit its slots"):
        fused[0].fold(FOLD_SLOT_BYTES // 16 // 8 + 1, torch.float32)
    folds = [fused[r].fold(24, torch.float32) for r in range(2)]
    for call in range(4):
        got, want, unfolded, outs = one_call(folds, 3, 24, 20, torch.float32)
        check_call(folds, call, got, want, unfolded, outs, torch.float32)
