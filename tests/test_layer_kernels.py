"""The Triton backend's small per-layer kernels (RMSNorm with the residual add, RoPE with the
KV store, SiLU-and-multiply) against ``kernels.reference``, which rounds as Hugging Face does.

Without a GPU they run in Triton's interpreter in float32 and float16 (its bfloat16 casts do
not round to nearest); with one, on it, in bfloat16 too. The residual sums, the RoPE outputs
and the stored K/V must be equal bit for bit; the norm and the SiLU may differ from torch by
two units in the last place (the order of a float32 sum, the float32 ``exp``: an ulp of the
rounded intermediate, scaled by the weight or by ``up``), and are also checked against float64
math.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from kernels import reference  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.norm import add_rms_norm, rms_norm  # noqa: E402
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
    assert torch.allclose(out.double(), exact, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)


def test_rms_norm_strided_rows_and_empty():
    x = torch.randn(4, 200, device=DEVICE)[:, :100]  # row stride 200
    w = torch.randn(100, device=DEVICE)
    assert_within_ulp(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), "strided")
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 100)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:50], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 3000])
def test_silu_and_mul_matches_reference(dtype, inter):
    x = (torch.randn(3, 2 * inter, device=DEVICE) * 4).to(dtype)
    out = silu_and_mul(x)
    assert_within_ulp(out, reference.silu_and_mul(x), "silu_and_mul", f32_ulps=16, half_ulps=2)
    g, u = x.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(g) * u
    assert torch.allclose(out.double(), exact, rtol=3 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (6, 2, 64), (8, 1, 128)])
def test_rope_write_kv_matches_reference(dtype, hq, hkv, d):
    t, page, blocks, positions_max = 9, 4, 5, 300
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width + 24, device=DEVICE).to(dtype)[:, :width]  # strided rows
    pos = torch.randint(0, positions_max, (t,), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = torch.arange(positions_max, device=DEVICE).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    slots = torch.randperm(page * blocks, device=DEVICE)[:t]
    slots[3] = -1  # a padding token: its K/V is not stored
    caches = [torch.full((blocks, page, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
              for _ in range(4)]  # fmt: skip
    q = rope_write_kv(qkv, pos, cos, sin, caches[0], caches[1], slots, hq, hkv)
    q_ref = reference.rope_write_kv(qkv, pos, cos, sin, caches[2], caches[3], slots, hq, hkv)
    tol = 2e-7 if dtype == torch.float32 else 0.0  # float32: a product and a sum may fuse
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), ref.isnan()), "stored a different set of slots"
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol, equal_nan=True)
    assert caches[0].view(-1, hkv, d)[slots[slots >= 0]].isnan().sum() == 0


def test_rope_write_kv_rejects_mismatched_shapes():
    qkv = torch.randn(2, 3 * 64, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 64, device=DEVICE)
    cos = torch.zeros(10, 32, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv, pos, cos, cos, cache, cache, slots, 2, 1)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(qkv, pos, cos[:, :16], cos[:, :16], cache, cache, slots, 1, 1)


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
    operation that runs here launches with that switch (``linear`` runs its kernel on CUDA
    only; decode: tests/test_kernels.py)."""
    import kernels.activation
    import kernels.norm
    import kernels.rope
    from flashserve.models.attention import load_backend

    seen = []

    def record(device, asked):
        seen.append(asked)
        return {"CHAIN": False}

    for module in (kernels.activation, kernels.norm, kernels.rope):
        monkeypatch.setattr(module, "pdl_kwargs", record)
    ops = load_backend("triton", pdl_chain=chain)
    x, w = torch.randn(2, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x, w, 1e-6)
    ops.silu_and_mul(x)
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    cos = torch.ones(10, 8, device=DEVICE)
    pos = slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ops.rope_write_kv(torch.randn(2, 48, device=DEVICE), pos, cos, cos, cache, cache.clone(),
                      slots, 1, 1)  # fmt: skip
    assert seen == [chain] * 4
