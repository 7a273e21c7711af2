"""Test-only helpers: run whole prompts through a model with the torch attention backend,
and tiny random Hugging Face reference models.

``run_prompts`` / ``run_chunks`` stand in for the ModelRunner in model and loader tests: they
build the per-layer paged KV caches and a step's ``AttentionMetadata`` by hand.
"""

from __future__ import annotations

import torch
import transformers

from flashserve.models.attention import AttentionMetadata


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖ours − ref‖ / ‖ref‖`` in float64."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm() / ref.norm()).item()


def describe_diff(ours: torch.Tensor, ref: torch.Tensor) -> str:
    """Where two tensors of one shape differ most, for assertion messages."""
    diff = (ours.double() - ref.double()).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return (
        f"rel err {rel_err(ours, ref):.3e}; max |diff| {diff.max().item():.3e} at {idx} "
        f"(ours {ours[idx].item():.6f}, ref {ref[idx].item():.6f})"
    )


def make_kv_caches(model, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, ...]]:
    """One zeroed (k_cache, v_cache) pair per layer, ``[N, BS, Hkv, D]`` each (the KV heads
    of the model's rank, when it is a tensor-parallel share)."""
    c = model.rank_config
    p = next(model.parameters())
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in range(c.num_hidden_layers)]


def block_tables(
    lens: list[int], block_size: int, shuffle: bool, gen: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """``[B, M]`` int32 block tables over a pool of all the blocks needed (shuffled or in
    order), padded with block 0; returns the table and the pool size."""
    need = [-(-n // block_size) for n in lens]
    total = sum(need)
    ids = torch.randperm(total, generator=gen) if shuffle else torch.arange(total)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start : start + n]
        start += n
    return table, total


def step_metadata(
    chunks: list[tuple[int, int]], table: torch.Tensor, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata of a step computing, for sequence ``b``, ``n`` tokens starting at position
    ``start`` (``chunks[b] = (start, n)``). Chunks with ``n == 1`` must come first: they are
    the decode part; the rest are prefill chunks."""
    nd = sum(1 for _, n in chunks if n == 1)
    if any(n != 1 for _, n in chunks[:nd]) or any(n == 1 for _, n in chunks[nd:]):
        raise ValueError("decode chunks (one token) must precede prefill chunks")
    slots = []
    for b, (start, n) in enumerate(chunks):
        pos = torch.arange(start, start + n)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
    seq_lens = torch.tensor([s + n for s, n in chunks], dtype=torch.int32)
    q_lens = torch.tensor([n for _, n in chunks[nd:]], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    decode, prefill = seq_lens[:nd], seq_lens[nd:]
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        num_decode_tokens=nd,
        decode_seq_lens=decode.to(device) if nd else None,
        decode_block_tables=table[:nd].to(device) if nd else None,
        max_decode_seq_len=int(decode.max()) if nd else 0,
        num_prefill_tokens=int(q_lens.sum()),
        prefill_cu_seqlens_q=cu.to(device) if len(q_lens) else None,
        prefill_seq_lens=prefill.to(device) if len(q_lens) else None,
        prefill_block_tables=table[nd:].to(device) if len(q_lens) else None,
        max_prefill_query_len=int(q_lens.max()) if len(q_lens) else 0,
        max_prefill_seq_len=int(prefill.max()) if len(q_lens) else 0,
    )


@torch.no_grad()
def run_chunks(
    model,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    table: torch.Tensor,  # [B, M] int32, sequence b's blocks
    chunks: list[tuple[list[int], int]],  # (token ids, start position) of sequence b
    block_size: int,
) -> list[torch.Tensor]:
    """One model step over the given chunks; float32 logits ``[len(ids), V]`` per chunk."""
    device = next(model.parameters()).device
    meta = step_metadata([(s, len(ids)) for ids, s in chunks], table, block_size, device)
    flat = torch.tensor([t for ids, _ in chunks for t in ids], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(s, s + len(ids)) for ids, s in chunks]).to(device)
    hidden = model(flat, positions, caches, meta)  # [T, hidden]
    return list(model.compute_logits(hidden).split([len(ids) for ids, _ in chunks]))


def run_prompts(
    model, prompts: list[list[int]], block_size: int = 16, shuffle: bool = False, seed: int = 0
) -> list[torch.Tensor]:
    """Per-token float32 logits ``[len(prompt), V]`` of each prompt, all prefilled in one step
    through fresh paged KV caches (block tables in order, or shuffled with ``seed``).
    Prompts of one token are run as decode tokens, so put them first."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = block_tables([len(p) for p in prompts], block_size, shuffle, gen)
    caches = make_kv_caches(model, num_blocks, block_size)
    return run_chunks(model, caches, table, [(p, 0) for p in prompts], block_size)


# ---- tiny Hugging Face reference models -----------------------------------------------

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,  # low/high wavelengths 256/64: all 3 regimes
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
VARIANTS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied-llama3rope": (
        transformers.LlamaConfig,
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE},
    ),
    "llama-bias-linearrope": (
        transformers.LlamaConfig,
        {"attention_bias": True, "rope_parameters": LINEAR_ROPE, "num_key_value_heads": 4},
    ),
    "mistral-headdim32": (transformers.MistralConfig, {"head_dim": 32, "num_key_value_heads": 1}),
    "qwen2-tied": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that attention is far from uniform: N(0, 1/fan_in) for matrices,
    norms 1 + N(0, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5 * (3.0 if "embed" in name else 1.0))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def make_hf(variant: str, dtype: torch.dtype = torch.float32):
    cls, extra = VARIANTS[variant]
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **extra}))
    randomize(hf)
    return hf.to(dtype).eval()


def hf_logits(hf, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]


def random_prompts(lens: list[int], vocab: int) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,)).tolist() for n in lens]


def assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o.shape == r.shape, f"prompt {i}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
        assert rel_err(o, r) < tol, f"prompt {i} (len {len(o)}): {describe_diff(o, r)}"


# Two float32 logits of a reference closer than this are a tie that rounding may break either
# way: random weights put two of them 2.4e-7 apart (Phi-3 with LongRoPE, test_gguf_archs,
# 2026-11-28), and the reference and we then pick different tokens, both right.
TIE = 1e-5


def assert_greedy_matches(got: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> None:
    """Our greedy tokens are the reference's (its step logits ``ref_logits``, ``[V]`` each) up
    to the first step where the reference's logits of its token and ours tie (``TIE``); past
    that the sequences are different texts, and nothing more is compared."""
    assert len(got) == len(ref), f"ours {got}\nref  {ref}"
    for step, (ours, want, logits) in enumerate(zip(got, ref, ref_logits, strict=True)):
        if ours != want:
            gap = float(logits[want] - logits[ours])
            assert gap < TIE, f"step {step}: ours {got}\nref  {ref}\n(logit gap {gap:.3e})"
            return
