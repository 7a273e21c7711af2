"""Plain-torch reference of the kernels: attention over the paged KV cache, and the small
per-layer operations the Triton backend fuses (RMSNorm with the residual add, and with Gemma's
output norm before that add; RoPE with the KV store, SiLU-and-multiply), and the linear layers
(the Triton backend streams their weights with its own kernel at decode batch sizes).

This is both the ``torch`` backend (CPU and CUDA) and the ground truth the Triton kernels are
tested against (call the attention on float64 tensors for that). The per-layer operations round
exactly where Hugging Face transformers' Llama does, so the torch backend reproduces its logits.

Cache layout, shared with the Triton kernels: one pool per layer for K and one for V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its *slot* is
``block * block_size + offset``. An fp8 cache (``kernels.kv_quant``) adds scale pools
``k_scale``/``v_scale`` ``[num_blocks, num_kv_heads, block_size]``: ``write_kv`` quantizes into
it, and the attention dequantizes the pages it gathers (to float32, float64 for float64
queries) before the same math.

Grouped-query attention: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
Softmax is over ``scale * q.k``; the LSE returned is the natural-log log-sum-exp of those
scaled scores, ``[tokens, num_q_heads]`` in float32 (float64 for float64 inputs).

Attention has two implementations of the same formula, for two jobs: ``attention`` writes the
math out (scores, mask, log-sum-exp, softmax) and is the ground truth, in float64 too, with
the LSE the kernels are checked against; ``sdpa_attention`` hands the same float32 math to
``F.scaled_dot_product_attention``, which tiles it and never materialises the ``[Hq, Tq, Tk]``
scores: 7x faster on the CPU (a 2,048-token chunk, 9/3 heads of 64: 0.07 s against 0.53 s per
layer), which is what makes the torch backend usable for serving. ``prefill_attention`` takes
the fast one unless the LSE or float64 is asked for; tests/test_reference.py holds the two
equal within float32 rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_quant import check_kv_scales, dequantize_fp8, quantize_fp8
from kernels.quant import dequantize


class RowNorm(NamedTuple):
    """An RMSNorm left to the linear layer that reads its output (``kernels.gemv``'s
    ``norm=``; ``linear``'s here): that layer's x is the un-normed residual
    stream [M, K], and ``sumsq`` [M, P] float32 holds P partial sums of ``x**2`` of each row,
    whose total gives the row's 1 / rms (the sums a ``linear_add`` returns with the rows)."""

    sumsq: torch.Tensor  # [M, P] float32
    weight: torch.Tensor  # [K], x's dtype
    eps: float

    def check(self, x: torch.Tensor) -> None:
        """Refuse a norm that does not fit ``x`` [M, K]."""
        m, k = x.shape
        if self.weight.shape != (k,) or self.weight.dtype != x.dtype:
            raise ValueError(f"the norm's weight must be {x.dtype} [{k}]; got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")  # fmt: skip
        s = self.sumsq
        if s.dim() != 2 or s.shape[0] != m or s.shape[1] < 1 or s.dtype != torch.float32:
            raise ValueError(f"the norm's sums must be float32 [{m}, P >= 1]; got {s.dtype} "
                             f"{tuple(s.shape)}")  # fmt: skip
        if not s.is_contiguous() or s.device != x.device or self.weight.device != x.device:
            raise ValueError("the norm's sums must be contiguous, on x's device with its weight")


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None = None,  # [N]
    weight_scale: torch.Tensor | None = None,  # fp32 [N] or [cdiv(N, 128), cdiv(K, 128)]
    norm: RowNorm | None = None,
) -> torch.Tensor:  # [T, N]
    """``x @ weight.T + bias``; a float8 weight is first dequantized to x's dtype
    (``kernels.quant.dequantize``: ``weight * scale`` in float32, then rounded). ``norm``: of
    x RMSNormed first, from the row sums of squares it carries (``rows_normed``)."""
    if norm is not None:
        x = rows_normed(x, norm)
    if weight_scale is not None:
        weight = dequantize(weight, weight_scale, x.dtype)
    return F.linear(x, weight, bias)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:  # [..., H]
    """``weight * x / sqrt(mean(x^2) + eps)``: normalised in float32, cast back to ``x``'s dtype,
    then scaled by ``weight`` (Llama's rounding).

    unit_offset: Gemma's norm, ``(1 + weight) * x / sqrt(...)``, the scaling done in float32
    before the cast (Gemma's rounding)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def rows_normed(x: torch.Tensor, norm: RowNorm) -> torch.Tensor:  # [T, K]
    """``rms_norm(x, norm.weight, norm.eps)`` with each row's mean square taken from
    ``norm.sumsq`` (its partial sums of squares: what a ``linear_add`` left for the next
    norm), rounded as ``rms_norm`` rounds."""
    norm.check(x)
    rstd = torch.rsqrt(norm.sumsq.sum(-1, keepdim=True) / x.shape[-1] + norm.eps)
    return norm.weight * (x.float() * rstd).to(x.dtype)


def linear_add(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None,  # [N]
    weight_scale: torch.Tensor | None,
    residual: torch.Tensor,  # [T, N], the residual stream
) -> tuple[torch.Tensor, torch.Tensor]:  # residual + linear(x), sumsq [T, 1] float32
    """A sublayer's last projection added to the residual stream, with the sum of squares of
    each row of that sum (``RowNorm``'s ``sumsq``: the next norm's)."""
    h = residual + linear(x, weight, bias, weight_scale)
    return h, h.float().square().sum(-1, keepdim=True)


def add_rms_norm(
    x: torch.Tensor,  # [T, H], a sublayer's output
    residual: torch.Tensor,  # [T, H], the residual stream before it
    weight: torch.Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(residual + x), residual + x
    """The residual add of a sublayer and the RMSNorm of the next one."""
    residual = residual + x
    return rms_norm(residual, weight, eps, unit_offset), residual


def norm_add_norm(
    x: torch.Tensor,  # [T, H], a sublayer's output
    residual: torch.Tensor,  # [T, H], the residual stream before it
    post_weight: torch.Tensor,  # [H], the sublayer's own output norm
    weight: torch.Tensor,  # [H], the next sublayer's input norm
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(residual + rms_norm(x)), that residual
    """Gemma's sandwich between two sublayers: the output's own norm (``post_attention`` or
    ``post_feedforward_layernorm``), the residual add, and the next sublayer's input norm;
    the two calls composed, rounding where they round."""
    return add_rms_norm(rms_norm(x, post_weight, eps, unit_offset), residual, weight, eps,
                        unit_offset)  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SwiGLU's gate: ``silu(x[:, :I]) * x[:, I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Gemma's gate: ``gelu_tanh(x[:, :I]) * x[:, I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def linear_act_and_mul(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [2I, K], [gate; up]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None = None,  # [2I]
    weight_scale: torch.Tensor | None = None,  # fp32 [2I] or [cdiv(2I, 128), cdiv(K, 128)]
    act: str = "silu",  # or "gelu_tanh"
    norm: RowNorm | None = None,
) -> torch.Tensor:  # [T, I]
    """A gated MLP's fused gate/up projection and its activation: ``act(gate) * up`` of
    ``linear(x, weight, bias, weight_scale, norm)``, rounding where the two calls round."""
    return _ACT_AND_MUL[act](linear(x, weight, bias, weight_scale, norm))


_ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def apply_rope(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, 1, R/2], R <= D the rotated dims
    sin: torch.Tensor,  # [T, 1, R/2]
) -> torch.Tensor:  # [T, H, D]
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` (the two halves of
    the rotated dims turn together, as in Hugging Face's Llama) over the first ``R`` dims of
    each head; the rest pass through (partial rotary, Phi's ``partial_rotary_factor``)."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., : r // 2], x[..., r // 2 : r]  # [T, H, R/2] each
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat((*rotated, x[..., r:]), dim=-1)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], a fused projection's output
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D/2], the model's RoPE table
    sin: torch.Tensor,  # [P, D/2]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 marks a padding token that is not stored
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,  # [D]: RMSNorm each query head before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None,  # [D]: the same for each key head
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,  # the q/k norms are Gemma's ``(1 + w)`` norms
    *,
    k_scale: torch.Tensor | None = None,  # [N, Hkv, BS]: an fp8 cache's scale pools
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D], the rotated queries
    """Rotate the queries and keys of a step by their positions and store K and V in the cache.

    The tables may be narrower than the head (``[P, R/2]``, ``R < D``): then only the first
    ``R`` dims of each head rotate. With ``q_norm``/``k_norm``, each head is RMS-normalised over
    its ``D`` dims first (``rms_norm``'s rounding). An fp8 cache stores the rotated keys (in
    the activations' dtype) and the values quantized (``write_kv``)."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, norm_eps, norm_unit_offset)
    if k_norm is not None:
        k = rms_norm(k, k_norm, norm_eps, norm_unit_offset)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, R/2]
    q = apply_rope(q, c, s)
    k = apply_rope(k, c, s)
    write_kv(k, v.view(t, num_kv_heads, d), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 marks a padding token that is not stored
    k_scale: torch.Tensor | None = None,  # [N, Hkv, BS]: an fp8 cache's scale pools
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K and V at its cache slot; an fp8 cache gets them quantized per
    (token, KV head) (``kv_quant.quantize_fp8``) and their scales at the same slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs  # (by page and row: pools of either layout)
    if not check_kv_scales(k_cache, k_scale, v_scale):
        k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)
        return
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, scale = quantize_fp8(x[keep])  # [T', Hkv, D], [T', Hkv]
        # as bytes: index_put has no float8 kernel on some devices and torch versions
        cache.view(torch.uint8)[blocks, offsets] = q.view(torch.uint8)
        scales[blocks, :, offsets] = scale


def gather_kv(
    cache: torch.Tensor,  # [N, BS, Hkv, D]
    block_table: torch.Tensor,  # [M] int
    seq_len: int,
    start: int = 0,
    scale: torch.Tensor | None = None,  # [N, Hkv, BS]: an fp8 cache's scales
    dtype: torch.dtype = torch.float32,  # what an fp8 cache is dequantized to
) -> torch.Tensor:  # [seq_len - start, Hkv, D]
    """One sequence's cached tokens ``start .. seq_len-1``, contiguous; dequantized to
    ``dtype`` with ``scale`` (an fp8 cache).

    Only the pages holding those tokens are indexed: with a sliding window, the pages left of
    the window's start may already be back in the pool and hold another sequence's K/V (or
    NaN), so neither their block-table entries nor their contents are touched."""
    block_size = cache.shape[1]
    first = start // block_size
    num_blocks = -(-seq_len // block_size)
    ids = block_table[first:num_blocks].long()
    if scale is None:
        pages = cache[ids]  # [nb - first, BS, Hkv, D]
    else:  # gathered as bytes (no float8 index kernel on some devices), then dequantized
        pages = cache.view(torch.uint8)[ids].view(cache.dtype)
        pages = dequantize_fp8(pages, scale[ids].transpose(1, 2), dtype)
    skip = start - first * block_size
    return pages.reshape(-1, *cache.shape[2:])[skip : seq_len - first * block_size]


def _window_start(seq_len: int, q_len: int, window: int) -> int:
    """The first key position that any of a chunk's ``q_len`` queries (the last of ``seq_len``
    positions) sees: 0 without a window, else the first query's ``p - window + 1``."""
    return max(0, seq_len - q_len - window + 1) if window > 0 else 0


def attention(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    scale: float,
    causal: bool = True,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, Hq, D], lse [Tq, Hq]
    """Attention of one sequence's queries, the last ``Tq`` of its ``Tk`` positions.

    window: when > 0, the query at position ``p`` sees only keys ``p - window < j <= p``
    (Hugging Face's sliding window: the query's own position and ``window - 1`` before it).
    softcap: when > 0, the scaled scores become ``softcap * tanh(score / softcap)`` (Gemma 2's
    attention logit soft-capping), before the mask and the softmax; the LSE is of those.
    Computed in float32, or float64 when the inputs are float64.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.to(acc).transpose(0, 1)  # [Hq, Tq, D]
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or window > 0:
        scores = scores.masked_fill(~_visible(tq, 0, tk, window, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
    out = torch.matmul(torch.exp(scores - lse[..., None]), vf)  # [Hq, Tq, D]
    return out.transpose(0, 1), lse.transpose(0, 1)


def _visible(
    tq: int, k_start: int, tk: int, window: int, device: torch.device
) -> torch.Tensor:  # [Tq, Tk - k_start] bool
    """Which keys ``k_start .. tk-1`` each of the last ``tq`` of ``tk`` positions sees: causal,
    and within ``window`` when it is > 0."""
    q_pos = torch.arange(tk - tq, tk, device=device)[:, None]
    k_pos = torch.arange(k_start, tk, device=device)[None, :]
    seen = k_pos <= q_pos
    if window > 0:
        seen &= k_pos > q_pos - window
    return seen


def sdpa_attention(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    scale: float,
    q_block: int = 256,
    window: int = 0,
) -> torch.Tensor:  # [Tq, Hq, D] float32
    """``attention(q, k, v, scale, causal=True, window=window)[0]`` (no LSE) through SDPA, in
    float32.

    SDPA's ``is_causal`` aligns the mask top-left, which equals our bottom-right one only when
    ``Tq == Tk``; a single query sees every key. A chunk over cached context (``1 < Tq < Tk``)
    needs the mask spelt out, and SDPA then computes every score of ``[Tq, Tk]``, the masked
    triangle too; so it goes ``q_block`` queries at a time, each block over the keys its last
    query sees: the work left masked is ``Tq * q_block / 2`` scores, not ``Tq^2 / 2``. The
    three 2,048-token chunks of a 6,000-token prompt (9/3 heads of 64, 2 CPU cores): 0.89 CPU-s
    per layer with one masked call per chunk, 0.79 / 0.73 / 0.70 / 0.74 with blocks of 1,024 /
    512 / 256 / 128 queries, 0.63 for the whole prompt in one causal call. With a ``window``,
    each block reads only the keys from its first query's window on.
    """
    tq, tk = q.shape[0], k.shape[0]
    if window <= 0 or window >= tk:
        if tq == tk or tq == 1:
            return _sdpa(q, k, v, scale, causal=tq > 1)
        window = 0
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s in range(0, tq, q_block):
        e = min(tq, s + q_block)
        seen = tk - tq + e  # keys that the block's last query sees
        first = max(0, tk - tq + s - window + 1) if window > 0 else 0
        mask = _visible(e - s, first, seen, window, q.device)
        out[s:e] = _sdpa(q[s:e], k[first:seen], v[first:seen], scale, mask=mask)
    return out


def _sdpa(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    scale: float,
    causal: bool = False,  # top-left aligned
    mask: torch.Tensor | None = None,  # [Tq, Tk] bool, True: attend
) -> torch.Tensor:  # [Tq, Hq, D] float32
    """One ``F.scaled_dot_product_attention`` call on our layout, grouped heads unexpanded."""
    gqa = q.shape[1] != k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
    out = F.scaled_dot_product_attention(
        qf, kf, vf, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )  # [1, Hq, Tq, D]
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32, KV length including the new token
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """One query token per sequence attending to its cached tokens (the last ``window`` of
    them when ``window`` > 0)."""
    del max_seq_len  # a hint for the kernels' split heuristic; the reference needs none
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return prefill_attention(
        q, k_cache, v_cache, cu, seq_lens, block_tables, scale, out=out,
        return_lse=return_lse, window=window, softcap=softcap, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the sequences' query chunks back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B+1] int32, offsets of each sequence's chunk in q
    seq_lens: torch.Tensor,  # [B] int32, KV length including this chunk
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    *,
    k_scale: torch.Tensor | None = None,  # [N, Hkv, BS]: an fp8 cache's scale pools
    v_scale: torch.Tensor | None = None,
):
    """Causal attention of each chunk over its sequence's cached context plus itself.

    The chunk's own K/V must already be in the cache. Query ``i`` of a chunk of length ``n``
    sits at position ``p = seq_len - n + i`` and sees positions ``<= p`` (and ``> p - window``
    when ``window`` > 0; ``softcap`` as in ``attention``). The explicit math (``attention``)
    runs when the LSE, float64 or soft-capping is asked for, SDPA (``sdpa_attention``) else.
    With a window, only the pages from the chunk's first query's window on are read
    (``gather_kv``'s ``start``): pages left of it may have been freed and reused. An fp8
    cache's pages are dequantized as they are gathered (float64 for float64 queries).
    """
    del max_query_len, max_seq_len
    check_kv_scales(k_cache, k_scale, v_scale)
    deq = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    lse_all = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    explicit = return_lse or softcap > 0 or q.dtype == torch.float64  # else through SDPA
    for b in range(len(lens)):
        qs = q[cu[b] : cu[b + 1]]
        if qs.shape[0] == 0:
            continue
        # keys from the first query's window on: the mask only depends on positions relative
        # to the queries, so attention() sees the same problem, shifted
        first = _window_start(lens[b], qs.shape[0], window)
        k = gather_kv(k_cache, block_tables[b], lens[b], first, k_scale, deq)
        v = gather_kv(v_cache, block_tables[b], lens[b], first, v_scale, deq)
        if not explicit:
            o = sdpa_attention(qs, k, v, scale, window=window)
            out[cu[b] : cu[b + 1]] = o.to(out.dtype)
            continue
        o, lse = attention(qs, k, v, scale, causal=True, window=window, softcap=softcap)
        out[cu[b] : cu[b + 1]] = o.to(out.dtype)
        if return_lse:
            if lse.dtype == torch.float64 and lse_all.dtype != torch.float64:
                lse_all = lse_all.to(torch.float64)
            lse_all[cu[b] : cu[b + 1]] = lse.to(lse_all.dtype)
    return (out, lse_all) if return_lse else out
