"""The model on CUDA: the Triton backend (fused norms, RoPE with the KV store, SiLU-and-multiply,
paged attention) against the torch backend on the same random weights, through a prefill in
two chunks and then decode steps. Run on the GPU machine: ``python3 -m pytest -q -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
from tensor_checks import rel_err

from flashserve.models.attention import AttentionMetadata, load_backend
from flashserve.models.config import ModelConfig
from flashserve.models.decoder import build_model, init_random

pytestmark = pytest.mark.gpu

BLOCK = 16
SHAPES = {  # Llama-3-8B's heads at 4 layers; SmolLM2's (head dim 64, 9/3 heads)
    "hd128": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128),
    "hd64": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64),
}  # fmt: skip


def _config(shape: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 1000, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        **SHAPES[shape],
    })  # fmt: skip


def _slots(start: int, n: int, table: torch.Tensor) -> torch.Tensor:
    """Cache slots of positions [start, start + n) through the (shuffled) block table."""
    pos = torch.arange(start, start + n, device=table.device)
    return table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK


def _prefill_meta(start: int, n: int, table: torch.Tensor) -> AttentionMetadata:
    dev = table.device
    return AttentionMetadata(
        slot_mapping=_slots(start, n, table),
        num_decode_tokens=0, decode_seq_lens=None, decode_block_tables=None,
        max_decode_seq_len=0, num_prefill_tokens=n,
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.tensor([start + n], dtype=torch.int32, device=dev),
        prefill_block_tables=table, max_prefill_query_len=n, max_prefill_seq_len=start + n,
    )  # fmt: skip


def _decode_meta(pos: int, table: torch.Tensor) -> AttentionMetadata:
    dev = table.device
    return AttentionMetadata(
        slot_mapping=_slots(pos, 1, table), num_decode_tokens=1,
        decode_seq_lens=torch.tensor([pos + 1], dtype=torch.int32, device=dev),
        decode_block_tables=table, max_decode_seq_len=pos + 1, num_prefill_tokens=0,
        prefill_cu_seqlens_q=None, prefill_seq_lens=None, prefill_block_tables=None,
        max_prefill_query_len=0, max_prefill_seq_len=0,
    )  # fmt: skip


def _run(
    backend: str, config: ModelConfig, dtype, tokens: list[int], chunk: int, follow: list[int]
) -> torch.Tensor:
    """Logits [prompt + follow, V] float32: the prompt in chunks, then the ``follow`` tokens one
    decode step each (the same tokens for every run, so that no run's near-tie picks another
    path)."""
    torch.manual_seed(0)
    model = build_model(config, load_backend(backend), "cuda", dtype)
    init_random(model, seed=3)
    n_blocks = -(-(len(tokens) + len(follow)) // BLOCK)
    shape = (n_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device="cuda"),
               torch.zeros(shape, dtype=dtype, device="cuda")) for _ in range(4)]  # fmt: skip
    table = torch.randperm(n_blocks, device="cuda").int()[None]  # shuffled pages
    ids = torch.tensor(tokens, device="cuda")
    out = []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            n = min(chunk, len(tokens) - start)
            pos = torch.arange(start, start + n, device="cuda")
            hidden = model(ids[start : start + n], pos, caches, _prefill_meta(start, n, table))
            out.append(model.compute_logits(hidden))
        for i, token in enumerate(follow):
            pos = len(tokens) + i
            step = torch.tensor([token], device="cuda")
            hidden = model(
                step, torch.tensor([pos], device="cuda"), caches, _decode_meta(pos, table)
            )
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_triton_backend_logits_match_torch_backend(shape, dtype, tol):
    """The Triton backend in ``dtype`` (prefill in 128-token chunks, then decode steps) against
    the torch backend in float32 (one prefill, the same decode tokens)."""
    config = _config(shape)
    tokens = torch.randint(0, config.vocab_size, (300,)).tolist()
    follow = torch.randint(0, config.vocab_size, (4,)).tolist()
    ref = _run("torch", config, torch.float32, tokens, chunk=300, follow=follow)
    got = _run("triton", config, dtype, tokens, chunk=128, follow=follow)
    assert torch.isfinite(got).all()
    for rows, what in ((slice(0, 300), "prefill"), (slice(300, None), "decode")):
        err = rel_err(got[rows], ref[rows])
        if err >= tol:  # for scale in the message: the torch backend's own error in dtype
            own = rel_err(_run("torch", config, dtype, tokens, 300, follow)[rows], ref[rows])
            pytest.fail(
                f"{shape} {dtype} {what}: rel err {err:.2e} >= {tol:.0e} against float32 "
                f"(the torch backend in {dtype}: {own:.2e})"
            )


def test_graph_greedy_path_equals_the_sampler():
    """A plain greedy batch takes its tokens from the CUDA graph's own argmax; asking for top
    logprobs sends the same batch through the sampler: same tokens, same logprobs."""
    from flashserve.config import EngineConfig
    from flashserve.engine.llm_engine import LLM
    from flashserve.sampling.params import SamplingParams

    llm = LLM(EngineConfig(model="dummy:tiny", device="cuda", dtype="float32", max_num_seqs=4))
    assert llm.engine.runner.graphs is not None
    prompts = [torch.randint(3, 500, (n,)).tolist() for n in (5, 40, 17)]
    plain = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with_top = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    a = llm.generate(prompts, plain)
    b = llm.generate(prompts, with_top)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
