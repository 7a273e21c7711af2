"""The Triton backend's small per-layer kernels (RMSNorm with the residual add, Gemma's
``(1 + w)`` form too, and Gemma's output norm before that add; RoPE with the q/k head norms,
partial rotary and the KV store; SiLU- and GELU-tanh-and-multiply) against
``kernels.reference``, which rounds as Hugging Face does.

Without a GPU they run in Triton's interpreter in float32 and float16 (its bfloat16 casts do
not round to nearest); with one, on it, in bfloat16 too. The residual sums, the RoPE outputs
without head norms and the stored K/V must be equal bit for bit; the norm and the gated
activations may differ from torch by two units in the last place (the order of a float32 sum,
the float32 ``exp``/``tanh``: an ulp of the rounded intermediate, scaled by the weight or by
``up``), and are also checked against float64 math. RoPE after a head norm carries the norm's
ulp through the rotation: within two ulps of the head's largest value.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from kernels import reference  # noqa: E402
from kernels.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from kernels.norm import add_rms_norm, norm_add_norm, rms_norm  # noqa: E402
from kernels.rope import rope_write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def assert_within_ulp(
    out: torch.Tensor, ref: torch.Tensor, what: str, f32_ulps: int = 4, half_ulps: int = 1
) -> None:
    """Same dtype and shape, and every element within one unit in the last place of ``ref``
    (float32: ``f32_ulps``, as float32 results are not rounded again and the float32 rsqrt
    and exp differ between libraries: Triton's exp on the GPU is the fast approximate one)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    info = torch.finfo(ref.dtype)
    ulps = f32_ulps if ref.dtype == torch.float32 else half_ulps
    diff = (out.double() - ref.double()).abs()
    tol = ref.double().abs() * info.eps * ulps + info.tiny
    bad = ~(diff <= tol)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off by more than {ulps} ulp; at {idx}: "
            f"got {out[idx].item()!r}, want {ref[idx].item()!r}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_matches_reference(dtype, hidden):
    t = 5
    x = (torch.randn(t, hidden, device=DEVICE) * 3).to(dtype)
    res = torch.randn(t, hidden, device=DEVICE).to(dtype)
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    eps = 1e-5
    # an ulp of the rounded normalised row, times the weight, can be two ulps of the output
    ref = reference.rms_norm(x, w, eps)
    assert_within_ulp(rms_norm(x, w, eps), ref, "rms_norm", half_ulps=2)
    out, new_res = add_rms_norm(x, res, w, eps)
    ref_out, ref_res = reference.add_rms_norm(x, res, w, eps)
    assert torch.equal(new_res, ref_res), "the residual sum must be bit-exact"
    assert_within_ulp(out, ref_out, "add_rms_norm", half_ulps=2)
    # and the math itself, in float64 (bf16: a few ulps from the two roundings)
    s = ref_res.double()
    exact = w.double() * s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    info = torch.finfo(dtype)  # a product of (1 + w) near 0 may be subnormal
    assert torch.allclose(out.double(), exact, rtol=4 * info.eps, atol=info.tiny)


def test_rms_norm_strided_rows_and_empty():
    x = torch.randn(4, 200, device=DEVICE)[:, :100]  # row stride 200
    w = torch.randn(100, device=DEVICE)
    assert_within_ulp(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), "strided")
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 100)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:50], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 640, 3840])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_gemma_unit_offset_norm_matches_reference(dtype, hidden, weight_dtype):
    """Gemma's ``((1 + w) * normed_f32).to(x.dtype)``: one rounding, so one ulp at most, and
    the output in the activations' dtype whatever the weight's (Gemma's weights sit near 0)."""
    t, eps = 5, 1e-6
    x = (torch.randn(t, hidden, device=DEVICE) * 3).to(dtype)
    res = torch.randn(t, hidden, device=DEVICE).to(dtype)
    w = (torch.randn(hidden, device=DEVICE) * 0.5).to(dtype if weight_dtype == "same" else
                                                      torch.float32)  # fmt: skip
    ref = reference.rms_norm(x, w, eps, True)
    assert_within_ulp(rms_norm(x, w, eps, True), ref, "rms_norm(unit_offset)")
    out, new_res = add_rms_norm(x, res, w, eps, unit_offset=True)
    ref_out, ref_res = reference.add_rms_norm(x, res, w, eps, True)
    assert torch.equal(new_res, ref_res), "the residual sum must be bit-exact"
    assert out.dtype == dtype, "Gemma's norm returns the activations' dtype"
    assert_within_ulp(out, ref_out, "add_rms_norm(unit_offset)")
    s = ref_res.double()
    scale = (1 + w.float()).double()  # as torch computes it (float32 w near -1 cancels)
    exact = scale * s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    info = torch.finfo(dtype)  # a product of (1 + w) near 0 may be subnormal
    assert torch.allclose(out.double(), exact, rtol=4 * info.eps, atol=info.tiny)
    # and the plain norm is not this one: the flag reaches the kernel
    assert not torch.allclose(rms_norm(x, w, eps).to(dtype), out)


def check_norm_add_norm(x, res, w_post, w, eps, unit_offset, what) -> None:
    """``norm_add_norm`` against the reference (the two calls composed). The first norm may be
    its ulps off torch's (the float32 sum order), which moves the residual by at most those
    ulps (of x's dtype) of the normed value before the sum rounds; the second norm is within
    its ulps of the norm of the kernel's residual; and both outputs equal, bit for bit, the
    two launches the fused one replaces (on the GPU a float32 first norm is not compared so:
    the separate kernels may contract a multiply-add that the fused one must not; for the same
    reason, where the fused kernel compiles without contraction (a first norm without
    ``unit_offset``), both outputs are compared within the ulps above there: H100, fp16 at
    3840, one element of 5 x 3840 differed in the second norm; bf16 at 3072, the residual)."""
    out, new_res = norm_add_norm(x, res, w_post, w, eps, unit_offset)
    ref_out, ref_res = reference.norm_add_norm(x, res, w_post, w, eps, unit_offset)
    assert (out.dtype, new_res.dtype) == (ref_out.dtype, ref_res.dtype), what
    assert out.shape == new_res.shape == x.shape, what
    h = reference.rms_norm(x, w_post, eps, unit_offset)  # [T, H]
    # ulps of x's dtype: the normalised row rounds to it (before a float32 weight, too)
    h_ulps = 4 if x.dtype == torch.float32 else (1 if unit_offset else 2)
    tol = (h_ulps * h.double().abs() * torch.finfo(x.dtype).eps
           + ref_res.double().abs() * torch.finfo(ref_res.dtype).eps
           + torch.finfo(h.dtype).tiny)  # fmt: skip
    check_residual(new_res, ref_res, tol, f"{what} residual")
    second = reference.rms_norm(new_res, w, eps, unit_offset)
    assert_within_ulp(out, second, f"{what} out", half_ulps=1 if unit_offset else 2)
    if h.dtype != torch.float32 or DEVICE == "cpu":
        sep_out, sep_res = add_rms_norm(rms_norm(x, w_post, eps, unit_offset), res, w, eps,
                                        unit_offset)  # fmt: skip
        if DEVICE == "cpu" or unit_offset:
            assert torch.equal(new_res, sep_res), f"{what}: residual differs from the two launches"
            assert torch.equal(out, sep_out), f"{what}: output differs from the two launches"
        else:  # the first norm, compiled without contraction, may round an ulp apart from the
            # separate kernel's (H100, bf16 at Phi-4-mini's 3072: the residual moved)
            check_residual(new_res, sep_res, tol, f"{what}: residual against the two launches'")
            assert_within_ulp(out, sep_out, f"{what}: output against the two launches'")


def check_residual(got, want, tol, what) -> None:
    """``got`` within ``tol`` (elementwise, float64) of ``want``; names the first element off."""
    bad = ~((got.double() - want.double()).abs() <= tol)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} elements off; at {idx}: got "
                             f"{got[idx].item()!r}, want {want[idx].item()!r}")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 640, 3840])
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_norm_add_norm_matches_reference(dtype, hidden, unit_offset, weight_dtype):
    """Gemma's two norms between sublayers in one launch (``post_*_layernorm``, the residual
    add, the next input norm), in both norm forms and with float32 weights, whose first norm
    torch returns in float32 without ``unit_offset`` (so the sum is a float32 one)."""
    t, eps = 5, 1e-6
    center = 0.0 if unit_offset else 1.0
    wdt = dtype if weight_dtype == "same" else torch.float32
    x = (torch.randn(t, hidden, device=DEVICE) * 3).to(dtype)
    res = (torch.randn(t, hidden, device=DEVICE) * 2).to(dtype)
    w_post, w = ((center + 0.3 * torch.randn(hidden, device=DEVICE)).to(wdt) for _ in range(2))
    check_norm_add_norm(x, res, w_post, w, eps, unit_offset, f"{dtype} {hidden}")
    # the first norm took effect: the residual is not the plain sum
    plain = reference.add_rms_norm(x, res, w, eps, unit_offset)[1]
    new_res = norm_add_norm(x, res, w_post, w, eps, unit_offset)[1]
    assert not torch.allclose(new_res.double(), plain.double(), atol=0.1)


def test_norm_add_norm_rejects_and_empty():
    x, w = torch.randn(3, 64, device=DEVICE), torch.zeros(64, device=DEVICE)
    out, new_res = norm_add_norm(x[:0], x[:0], w, w, 1e-6, True)
    assert out.shape == new_res.shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        norm_add_norm(x, x, w[:32], w, 1e-6, True)
    with pytest.raises(ValueError, match="weight"):
        norm_add_norm(x, x, w, w[:32], 1e-6, True)
    with pytest.raises(ValueError, match="residual"):
        norm_add_norm(x, x[:2], w, w, 1e-6, True)
    with pytest.raises(ValueError, match="post_weight"):  # torch would promote to float64
        norm_add_norm(x, x, w.double(), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 3000])
def test_silu_and_mul_matches_reference(dtype, inter):
    x = (torch.randn(3, 2 * inter, device=DEVICE) * 4).to(dtype)
    out = silu_and_mul(x)
    assert_within_ulp(out, reference.silu_and_mul(x), "silu_and_mul", f32_ulps=16, half_ulps=2)
    g, u = x.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(g) * u
    assert torch.allclose(out.double(), exact, rtol=3 * torch.finfo(dtype).eps, atol=1e-6)


def assert_gelu_close(out: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within two ulps of ``ref`` (sixteen in float32, as for SiLU), or within four float32
    quanta of ``1 + tanh`` near -1 (2^-24 each, times ``0.5 |gate| |up|``): where ``tanh(u)``
    nears -1, torch's ``1 + tanh(u)`` is a few multiples of 2^-24, and a tanh one float32 ulp
    off changes it by a whole multiple."""
    g, u = x.double().chunk(2, dim=-1)
    quanta = 4 * 2.0**-24 * 0.5 * (g * u).abs()
    info = torch.finfo(ref.dtype)
    ulps = 16 if ref.dtype == torch.float32 else 2
    diff = (out.double() - ref.double()).abs()
    bad = ~(diff <= ref.double().abs() * info.eps * ulps + info.tiny + quanta)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} elements off; at {idx}: gate "
                             f"{g[idx].item()!r}, got {out[idx].item()!r}, want "
                             f"{ref[idx].item()!r}")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 3000])
def test_gelu_tanh_and_mul_matches_reference(dtype, inter):
    x = (torch.randn(3, 2 * inter, device=DEVICE) * 4).to(dtype)
    x[0, :12] = torch.tensor([-12.0, -7.0, -5.5, -4.0, -1e-3, 0.0, 1e-3, 0.5, 3.0, 8.0, 20.0, 90.0])
    out = gelu_tanh_and_mul(x)
    assert out.shape == (3, inter) and out.dtype == dtype
    assert_gelu_close(out, x, reference.gelu_tanh_and_mul(x), "gelu_tanh_and_mul")
    g, u = x.double().chunk(2, dim=-1)
    exact = 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
    assert_gelu_close(out, x, exact.to(dtype), "gelu_tanh_and_mul against float64")
    assert not torch.allclose(out, silu_and_mul(x)), "the SiLU kernel is not GELU's"


def rope_tables(positions_max: int, rot: int, dtype, base: float = 10000.0):
    """cos, sin ``[P, rot/2]`` of the usual inverse frequencies over ``rot`` dims."""
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
    freqs = torch.arange(positions_max, device=DEVICE).float()[:, None] * inv[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rot"),
    [(4, 4, 64, 64), (6, 2, 64, 64), (8, 1, 128, 128), (3, 1, 80, 80), (2, 2, 96, 96),
     (4, 2, 256, 256), (3, 1, 96, 32), (2, 1, 128, 96)],
)  # fmt: skip
@pytest.mark.parametrize("split", [(1, 1), (2, 1), (4, 2), None])
def test_rope_write_kv_matches_reference(dtype, hq, hkv, d, rot, split):
    """Bit for bit; head dims 64-256, partial rotary (``rot < d``: the rest pass through); one
    head a program, two, four (some programs with fewer heads than that), the default."""
    t, page, blocks, positions_max = 9, 4, 5, 300
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width + 24, device=DEVICE).to(dtype)[:, :width]  # strided rows
    pos = torch.randint(0, positions_max, (t,), device=DEVICE)
    cos, sin = rope_tables(positions_max, rot, dtype)
    slots = torch.randperm(page * blocks, device=DEVICE)[:t]
    slots[3] = -1  # a padding token: its K/V is not stored
    caches = [torch.full((blocks, page, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
              for _ in range(4)]  # fmt: skip
    q = rope_write_kv(qkv, pos, cos, sin, caches[0], caches[1], slots, hq, hkv,
                      heads_per_program=split)  # fmt: skip
    q_ref = reference.rope_write_kv(qkv, pos, cos, sin, caches[2], caches[3], slots, hq, hkv)
    tol = 2e-7 if dtype == torch.float32 else 0.0  # float32: a product and a sum may fuse
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), ref.isnan()), "stored a different set of slots"
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol, equal_nan=True)
    assert caches[0].view(-1, hkv, d)[slots[slots >= 0]].isnan().sum() == 0
    if rot < d:  # the dims past the rotated ones are the input's, untouched
        assert torch.equal(q[..., rot:], qkv[:, : hq * d].reshape(t, hq, d)[..., rot:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rot", "norms", "unit_offset"),
    [(4, 2, 128, 128, "qk", False), (6, 2, 64, 64, "k", False), (2, 1, 256, 256, "qk", True),
     (3, 1, 80, 40, "qk", False), (4, 4, 96, 96, "q", True)],
)  # fmt: skip
@pytest.mark.parametrize("split", [(1, 1), (4, 4)])
def test_rope_write_kv_with_head_norms_matches_reference(dtype, hq, hkv, d, rot, norms,
                                                         unit_offset, split):  # fmt: skip
    """q/k head RMSNorm before the rotation (Qwen3; Gemma 3 with ``(1 + w)``), fused: within
    two ulps of each head's largest value (the norm's float32 sum order moves a normed value
    by an ulp, which the rotation carries; float32: ``assert_heads_close``), the V cache bit
    for bit."""
    t, page, blocks, positions_max, eps = 9, 4, 5, 300, 1e-6
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(t, width, device=DEVICE) * 3).to(dtype)
    pos = torch.randint(0, positions_max, (t,), device=DEVICE)
    cos, sin = rope_tables(positions_max, rot, dtype)
    slots = torch.randperm(page * blocks, device=DEVICE)[:t]
    slots[0] = -1
    center = 0.0 if unit_offset else 1.0  # Gemma's weights sit near 0, the others' near 1
    q_norm = (center + 0.3 * torch.randn(d, device=DEVICE)).to(dtype) if "q" in norms else None
    k_norm = (center + 0.3 * torch.randn(d, device=DEVICE)).to(dtype) if "k" in norms else None
    caches = [torch.full((blocks, page, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
              for _ in range(4)]  # fmt: skip
    args = (hq, hkv, q_norm, k_norm, eps, unit_offset)
    q = rope_write_kv(qkv, pos, cos, sin, caches[0], caches[1], slots, *args,
                      heads_per_program=split)  # fmt: skip
    q_ref = reference.rope_write_kv(qkv, pos, cos, sin, caches[2], caches[3], slots, *args)
    assert_heads_close(q, q_ref, "q")
    kept = slots[slots >= 0]
    k, k_ref = (c.view(-1, hkv, d)[kept] for c in (caches[0], caches[2]))
    assert_heads_close(k, k_ref, "k")
    assert torch.equal(caches[0].isnan(), caches[2].isnan()), "stored a different set of slots"
    assert torch.equal(caches[1].view(-1, hkv, d)[kept], caches[3].view(-1, hkv, d)[kept])
    if q_norm is not None:  # the norm took effect (the reference is not the kernel)
        plain = reference.rope_write_kv(qkv, pos, cos, sin, caches[2].clone(),
                                        caches[3].clone(), slots, hq, hkv)  # fmt: skip
        assert not torch.allclose(q.float(), plain.float(), atol=0.1), "q_norm ignored"


def assert_heads_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``[T, H, D]`` within two ulps of each head's largest magnitude in ``ref`` (float32:
    eight, as its normed values are not rounded and may be four ulps off, as in
    ``assert_within_ulp``, in each of the rotation's two terms)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    scale = ref.double().abs().amax(-1, keepdim=True)  # [T, H, 1]
    ulps = 8 if ref.dtype == torch.float32 else 2
    tol = ulps * torch.finfo(ref.dtype).eps * scale
    diff = (out.double() - ref.double()).abs()
    bad = ~(diff <= tol)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} elements off by more than {ulps} ulps "
                             f"of their head's largest; at {idx}: got {out[idx].item()!r}, "
                             f"want {ref[idx].item()!r}")  # fmt: skip


def test_rope_write_kv_rejects_mismatched_shapes():
    qkv = torch.randn(2, 3 * 64, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 64, device=DEVICE)
    cos = torch.zeros(10, 32, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv, pos, cos, cos, cache, cache, slots, 2, 1)
    qkv1 = torch.randn(2, 3 * 64, device=DEVICE)
    wide = torch.zeros(10, 33, device=DEVICE)
    with pytest.raises(ValueError, match="cos"):  # wider than half the head
        rope_write_kv(qkv1, pos, wide, wide, cache, cache, slots, 1, 1)
    with pytest.raises(ValueError, match="q_norm"):
        rope_write_kv(qkv1, pos, cos, cos, cache, cache, slots, 1, 1, torch.ones(32))
    with pytest.raises(ValueError, match="k_norm"):  # torch would promote q to float64
        rope_write_kv(qkv1, pos, cos, cos, cache, cache, slots, 1, 1, None,
                      torch.ones(64, dtype=torch.float64))  # fmt: skip
    with pytest.raises(ValueError, match="heads_per_program"):
        rope_write_kv(qkv1, pos, cos, cos, cache, cache, slots, 1, 1, heads_per_program=(3, 1))


def test_pdl_chain_is_asked_for_and_needs_the_device(monkeypatch):
    """A kernel joins the PDL chain when its launcher is asked to (``chain=``) and the device
    can (sm_90+): no environment switch."""
    from kernels import common

    cpu = torch.device("cpu")
    assert common.pdl_kwargs(cpu, True) == {"CHAIN": False}  # no PDL here
    monkeypatch.setattr(common, "pdl_wait", lambda device: True)  # as on sm_90+
    assert common.pdl_kwargs(cpu, True) == {"CHAIN": True, "launch_pdl": True}
    assert common.pdl_kwargs(cpu, False) == {"CHAIN": False}


@pytest.mark.parametrize("chain", [True, False])
def test_triton_backend_passes_its_pdl_chain_switch(monkeypatch, chain):
    """``load_backend("triton", pdl_chain=...)`` (EngineConfig.pdl_chain): each chained
    operation that runs here launches with that switch (``linear_act_and_mul`` is the fused
    GEMV on CUDA, ``linear`` then the activation kernel on the CPU: one chained launch either
    way; decode: tests/test_kernels.py)."""
    import kernels.activation
    import kernels.gemv
    import kernels.norm
    import kernels.rope
    from flashserve.models.attention import load_backend

    seen = []

    def record(device, asked):
        seen.append(asked)
        return {"CHAIN": False}

    for module in (kernels.activation, kernels.gemv, kernels.norm, kernels.rope):
        monkeypatch.setattr(module, "pdl_kwargs", record)
    ops = load_backend("triton", pdl_chain=chain)
    x, w = torch.randn(2, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x, w, 1e-6)
    ops.norm_add_norm(x, x, w, w, 1e-6)
    ops.silu_and_mul(x)
    ops.gelu_tanh_and_mul(x)
    ops.linear_act_and_mul(x, torch.randn(32, 64, device=DEVICE), None, None, "gelu_tanh")
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    cos = torch.ones(10, 8, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ops.rope_write_kv(torch.randn(2, 48, device=DEVICE), pos, cos, cos, cache, cache.clone(),
                      slots, 1, 1)  # fmt: skip
    assert seen == [chain] * 7


@pytest.mark.parametrize("path", ["portable", "auto", "hopper"])
def test_triton_backend_passes_its_prefill_path(monkeypatch, path):
    """``load_backend("triton", prefill_path=...)`` (EngineConfig.prefill_path) reaches
    every prefill call of the backend."""
    import kernels.prefill
    from flashserve.models.attention import load_backend

    seen = []
    monkeypatch.setattr(kernels.prefill, "prefill_attention",
                        lambda *args, path, **kw: seen.append(path))  # fmt: skip
    ops = load_backend("triton", prefill_path=path)
    ops.prefill_attention()
    assert seen == [path]


# (hidden, heads, kv heads, head dim, rotated dims, head norms, Gemma's norms, MLP width)
MODEL_SHAPES = {
    "qwen3-8b": (4096, 32, 8, 128, 128, True, False, 12288),
    "gemma3-12b": (3840, 16, 8, 256, 256, True, True, 15360),
    "phi4-mini": (3072, 24, 8, 128, 96, False, False, 8192),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(MODEL_SHAPES))
def test_layer_kernels_at_model_shapes_in_bf16(shape):
    """One decode-sized and one prefill-sized step of each small kernel at a real model's
    shape, bf16 on the GPU: RoPE without head norms and GELU bit for bit (libdevice's tanhf
    is the one torch's CUDA kernel calls), the norms within their ulps."""
    hidden, hq, hkv, d, rot, qk_norm, gemma, inter = MODEL_SHAPES[shape]
    dt, eps = torch.bfloat16, 1e-6
    center = 0.0 if gemma else 1.0
    for t in (3, 300):
        x, res = (torch.randn(t, hidden, device=DEVICE).to(dt) for _ in range(2))
        w = (center + 0.3 * torch.randn(hidden, device=DEVICE)).to(dt)
        out, new_res = add_rms_norm(x, res, w, eps, gemma)
        ref_out, ref_res = reference.add_rms_norm(x, res, w, eps, gemma)
        assert torch.equal(new_res, ref_res)
        assert_within_ulp(out, ref_out, f"{shape} add_rms_norm", half_ulps=1 if gemma else 2)
        w_post = (center + 0.3 * torch.randn(hidden, device=DEVICE)).to(dt)
        check_norm_add_norm(x, res, w_post, w, eps, gemma, f"{shape} norm_add_norm")
        gate_up = (torch.randn(t, 2 * inter, device=DEVICE) * 3).to(dt)
        act = gelu_tanh_and_mul if gemma else silu_and_mul
        ref_act = (reference.gelu_tanh_and_mul if gemma else reference.silu_and_mul)(gate_up)
        if gemma:
            assert torch.equal(act(gate_up), ref_act), f"{shape}: GELU differs from torch's"
        else:
            assert_within_ulp(act(gate_up), ref_act, f"{shape} silu_and_mul", half_ulps=2)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dt)
        pos = torch.randint(0, 8192, (t,), device=DEVICE)
        cos, sin = rope_tables(8192, rot, dt)
        slots = torch.randperm(t + 16, device=DEVICE)[:t]
        norms = [(center + 0.3 * torch.randn(d, device=DEVICE)).to(dt) for _ in range(2)]
        norms = norms if qk_norm else [None, None]
        caches = [torch.zeros(t // 16 + 2, 16, hkv, d, device=DEVICE, dtype=dt) for _ in range(4)]
        args = (slots, hq, hkv, *norms, eps, gemma)
        q = rope_write_kv(qkv, pos, cos, sin, caches[0], caches[1], *args)
        q_ref = reference.rope_write_kv(qkv, pos, cos, sin, caches[2], caches[3], *args)
        assert torch.equal(caches[1], caches[3])
        if qk_norm:
            assert_heads_close(q, q_ref, f"{shape} q")
            assert_heads_close(caches[0], caches[2], f"{shape} k cache")
        else:
            assert torch.equal(q, q_ref) and torch.equal(caches[0], caches[2]), shape
