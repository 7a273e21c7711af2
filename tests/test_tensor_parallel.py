"""Tensor parallelism on the CPU: the sharding rules, and a model split over two ranks (gloo,
torch backend, float32) against the same model whole.

- the rules (``flashserve.models.sharding``): each family of tensors (column, row, vocabulary,
  replicated), fused q/k/v and gate/up, KV heads replicated when there are fewer than ranks,
  the vocabulary's padding, a row-parallel bias added once, float8 weight scales following
  their weights; what does not split is refused in one line;
- every architecture (tiny checkpoints written by transformers, as tests/test_model_archs.py
  writes them; a GGUF file; dummy weights): the prompt's logits and 16 greedy decode steps'
  logits within 1e-5 of one rank's (only the order of the all-reduce's sums differs), and the
  same greedy tokens. Rank 1 is one helper process for the whole module (tests/tp_harness.py);
- float8 weights (fp8 checkpoints per tensor, per channel and in 128x128 blocks, as
  tests/test_fp8_loading.py writes them; ``--quantization fp8`` of a float checkpoint and of
  dummy weights): each rank holds exactly its share of the one-rank model's float8 weights and
  scales, and the two ranks match one as above.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from gguf_writer import write_gguf
from model_utils import describe_diff, rel_err
from safetensors.torch import save_file
from test_fp8_loading import CFG as FP8_CFG
from test_fp8_loading import write_pair
from test_model_archs import CASES, SHAPE, VOCAB, save_checkpoint
from tp_harness import RankPair, check_fp8_share, check_runner_collectives, greedy_logits

from flashserve.loaders.hf import Checkpoint
from flashserve.models.config import ModelConfig
from flashserve.models.sharding import (
    SINGLE,
    RankShape,
    Shard,
    check_block_scales,
    check_shardable,
    rank_config,
    tensor_shard,
)

STEPS = 16
TOL = 1e-5

# ---- the rules --------------------------------------------------------------------------------

# 8 query heads of 4 dims, 2 KV heads, MLP 12, vocabulary 10
RULES = ModelConfig(
    architecture="llama", vocab_size=10, hidden_size=6, intermediate_size=12,
    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
)  # fmt: skip


def _parts(name: str, full: torch.Tensor, size: int, config=RULES) -> list[torch.Tensor]:
    return [tensor_shard(name, config, r, size, tuple(full.shape)).take(full) for r in range(size)]


def test_column_parallel_projections_split_their_rows_by_heads():
    q = torch.randn(32, 6)  # 8 heads x 4
    assert torch.equal(torch.cat(_parts("model.layers.0.self_attn.q_proj.weight", q, 2)), q)
    k = torch.randn(8, 6)  # 2 KV heads x 4
    parts = _parts("model.layers.0.self_attn.k_proj.weight", k, 2)
    assert [p.shape[0] for p in parts] == [4, 4] and torch.equal(torch.cat(parts), k)
    bias = torch.randn(8)
    assert torch.equal(_parts("model.layers.0.self_attn.v_proj.bias", bias, 2)[1], bias[4:])
    gate = torch.randn(12, 6)
    assert torch.equal(_parts("model.layers.0.mlp.gate_proj.weight", gate, 4)[3], gate[9:])


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_rank_reads():
    """4 ranks, 2 KV heads: ranks 0-1 hold head 0 (query heads 0-3 read it), 2-3 head 1."""
    k = torch.arange(8.0).repeat_interleave(6).view(8, 6)  # row i holds i
    heads = [int(p[0, 0]) // 4 for p in _parts("model.layers.0.self_attn.k_proj.weight", k, 4)]
    assert heads == [0, 0, 1, 1]
    local = rank_config(RULES, 4)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert local.intermediate_size == 3 and local.vocab_size == 10  # the embeddings: whole


def test_fused_projections_take_each_part_s_rows():
    """Phi-3's fused qkv_proj / gate_up_proj (and our own parameters): rank r holds its q,
    then its k, then its v rows; its gate rows, then its up rows."""
    q, k, v = torch.randn(32, 6), torch.randn(8, 6), torch.randn(8, 6)
    fused = _parts("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]), 2)
    assert torch.equal(fused[1], torch.cat([q[16:], k[4:], v[4:]]))
    gate, up = torch.randn(12, 6), torch.randn(12, 6)
    fused = _parts("model.layers.0.mlp.gate_up_proj.weight", torch.cat([gate, up]), 3)
    assert torch.equal(fused[2], torch.cat([gate[8:], up[8:]]))


def test_row_parallel_projections_split_columns_and_add_their_bias_once():
    o = torch.randn(6, 32)
    parts = _parts("model.layers.0.self_attn.o_proj.weight", o, 2)
    assert torch.equal(torch.cat(parts, dim=1), o)
    down = torch.randn(6, 12)
    assert torch.equal(_parts("model.layers.0.mlp.down_proj.weight", down, 3)[1], down[:, 4:8])
    bias = torch.randn(6)
    parts = _parts("model.layers.0.self_attn.o_proj.bias", bias, 2)
    assert torch.equal(parts[0], bias) and torch.equal(parts[1], torch.zeros(6))


def test_lm_head_rows_split_and_pad_and_the_rest_is_replicated():
    """The LM head's 10 rows over 4 ranks: 3 each, the last rank's third row padding (zeros);
    over 6, the last rank holds only padding. The embeddings are whole on every rank."""
    emb = torch.randn(10, 6)
    parts = _parts("lm_head.weight", emb, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 3, 3]
    assert torch.equal(torch.cat(parts)[:10], emb) and not parts[3][1:].any()
    assert not _parts("lm_head.weight", emb, 6)[5].any()
    assert all(torch.equal(p, emb) for p in _parts("model.embed_tokens.weight", emb, 4))
    ranges = [RankShape(RULES, r, 4).vocab_range() for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert RankShape(RULES, 5, 6).vocab_range() == (10, 10)
    norm = torch.randn(6)
    assert all(torch.equal(p, norm) for p in _parts("model.layers.0.input_layernorm.weight",
                                                      norm, 2))  # fmt: skip
    q_norm = torch.randn(4)
    assert torch.equal(_parts("model.layers.0.self_attn.q_norm.weight", q_norm, 2)[1], q_norm)


def test_float8_scales_follow_their_weights():
    """Per-channel scales split with a column-parallel weight's rows and are whole for a
    row-parallel one; 128x128 block scales split in whole blocks; a tensor-wise one is whole."""
    big = ModelConfig(architecture="llama", vocab_size=10, hidden_size=256,
                          intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=4, head_dim=64)  # fmt: skip
    up = "model.layers.0.mlp.up_proj.weight_scale"
    per_row = torch.randn(512)
    assert torch.equal(_parts(up, per_row, 2, big)[1], per_row[256:])
    assert torch.equal(_parts(up, per_row.view(512, 1), 2, big)[0], per_row[:256].view(256, 1))
    down = "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert torch.equal(_parts(down, per_row[:256], 2, big)[1], per_row[:256])
    blocks = torch.randn(4, 2)  # up: [512, 256] in 128-blocks
    assert torch.equal(_parts(up, blocks, 2, big)[1], blocks[2:])
    down_blocks = torch.randn(2, 4)  # down: [256, 512]
    assert torch.equal(_parts(down, down_blocks, 4, big)[3], down_blocks[:, 3:])
    fused = torch.randn(8, 2)  # gate_up: [1024, 256]
    got = _parts("model.layers.0.mlp.gate_up_proj.weight_scale", fused, 2, big)[1]
    assert torch.equal(got, torch.cat([fused[2:4], fused[6:8]]))
    assert torch.equal(_parts(up, torch.tensor(0.5), 2, big)[1], torch.tensor(0.5))
    with pytest.raises(ValueError, match="whole blocks"):  # 64-row ranges
        _parts(up, torch.randn(4, 2), 8, big)


def test_block_scales_split_only_in_whole_blocks():
    """Heads of 128, MLP 512: two ranks hold 2 query heads, 1 KV head, 256 MLP rows each; four
    hold 1 query head and the KV head it reads (replicated), 128 rows. Heads of 64: a rank's
    one KV head is 64 rows, which would share a block with its neighbour's."""
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=320,
                         intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128)  # fmt: skip
    check_block_scales(config, 2)
    check_block_scales(config, 4)
    small = dataclasses.replace(config, head_dim=64)
    with pytest.raises(ValueError) as err:
        check_block_scales(small, 2)
    assert str(err.value) == (
        "tensor-parallel size 2 would split 128x128 block-scaled fp8 weights inside their "
        "blocks: each rank's rows (k_proj/v_proj 64) must be multiples of 128"
    )


@pytest.mark.parametrize(
    "heads, kv, inter, size, message",
    [
        (9, 3, 12, 2, "does not divide its 9 attention heads"),
        (8, 8, 12, 3, "attention heads nor its 8 KV heads"),
        (12, 4, 12, 3, "does not divide its 4 KV heads"),
        (8, 2, 10, 4, "does not divide its MLP width 10"),
    ],
)
def test_what_does_not_split_is_refused_in_one_line(heads, kv, inter, size, message):
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=6,
                             intermediate_size=inter, num_hidden_layers=1,
                             num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=4)  # fmt: skip
    with pytest.raises(ValueError, match=message) as err:
        check_shardable(config, size)
    assert "\n" not in str(err.value)
    check_shardable(config, 1)


def test_safetensors_ranks_read_their_slices(tmp_path):
    """A rank reads each tensor's part through a safetensors slice: what ``take`` cuts."""
    tensors = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(48, 6),
        "model.embed_tokens.weight": torch.randn(10, 6).bfloat16(),
        "model.norm.weight": torch.randn(6),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(6),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = Checkpoint.open(tmp_path)
    for rank in range(4):

        def shard(name: str, shape: tuple[int, ...], dtype=None, rank=rank) -> Shard:
            return tensor_shard(name, RULES, rank, 4, shape)

        for name, got in checkpoint.weights(shard):
            want = shard(name, tuple(tensors[name].shape)).take(tensors[name])
            assert got.dtype == want.dtype and torch.equal(got, want), (name, rank)


# ---- two ranks against one --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    ranks = RankPair()
    yield ranks
    ranks.close()


def test_ranks_agree_on_the_kv_pool_and_take_rank_0_s_tokens(pair):
    """Each rank sizes its pool from its own device's memory; the block tables of the one
    scheduler hold for all only at the smallest count."""
    assert pair.run(check_runner_collectives, [1000, 640], [7, 3, 11])
    assert pair.run(check_runner_collectives, [512, 4096], [1])


def _check_pair(pair: RankPair, spec: str, prompt: list[int], max_model_len=None,
                quantization=None) -> None:  # fmt: skip
    one = greedy_logits(SINGLE, spec, prompt, STEPS, max_model_len, quantization)
    two = pair.run(greedy_logits, spec, prompt, STEPS, max_model_len, quantization)
    assert rel_err(two[0][-1], one[0][-1]) < TOL, describe_diff(two[0][-1], one[0][-1])
    assert rel_err(two[0], one[0]) < TOL, f"prompt logits: {describe_diff(two[0], one[0])}"
    assert rel_err(two[1], one[1]) < TOL, f"decode logits: {describe_diff(two[1], one[1])}"
    assert two[2] == one[2], f"greedy tokens, 2 ranks {two[2]}\n            1 rank  {one[2]}"


# the architectures of test_model_archs, and two shapes of our own: one KV head for two ranks
# (replicated), and a vocabulary that does not split evenly (padding) under a logit soft-cap
PAIR_CASES = {
    name: (CASES[name].cls, CASES[name].kwargs, CASES[name].prompt_len, CASES[name].max_model_len)
    for name in ("llama-llama3-tied", "llama-linear-bias", "qwen2-window-layer1",
                 "qwen3-window-layer1", "mistral-window", "gemma2",
                 "gemma3-local-global-linear8", "phi3-longrope-short-partial")
}  # fmt: skip
PAIR_CASES["llama-one-kv-head"] = (transformers.LlamaConfig, {"num_key_value_heads": 1}, 30, None)
PAIR_CASES["gemma2-odd-vocab"] = (
    transformers.Gemma2Config,
    {**CASES["gemma2"].kwargs, "vocab_size": VOCAB - 3},
    30,
    None,
)


@pytest.mark.parametrize("name", list(PAIR_CASES))
def test_two_ranks_match_one(pair, tmp_path, name):
    cls, kwargs, prompt_len, max_model_len = PAIR_CASES[name]
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**SHAPE, **kwargs}))
    save_checkpoint(hf, tmp_path, "5.x")
    prompt = torch.randint(3, hf.config.vocab_size - 3, (prompt_len,)).tolist()
    _check_pair(pair, str(tmp_path), prompt, max_model_len)


def test_two_ranks_match_one_from_a_gguf_file(pair, tmp_path):
    """GGUF tensors are dequantized whole (Q/K un-permuted with all the heads), then cut."""
    config = transformers.LlamaConfig(**{**SHAPE, "attention_bias": True})
    hf = transformers.AutoModelForCausalLM.from_config(config)
    save_checkpoint(hf, tmp_path, "5.x")  # randomised
    write_gguf(tmp_path / "tiny.gguf", hf)
    prompt = torch.randint(3, VOCAB - 3, (25,)).tolist()
    _check_pair(pair, str(tmp_path / "tiny.gguf"), prompt)


def test_dummy_weights_are_the_same_whatever_the_ranks(pair):
    """Each rank draws every whole tensor and keeps its part: dummy:tiny split over two ranks
    is the one-rank model (bench decode compares like with like)."""
    _check_pair(pair, "dummy:tiny", torch.randint(3, 500, (20,)).tolist())


# ---- float8 weights ---------------------------------------------------------------------------

# test_fp8_loading's Llama (hidden 320: partial blocks along K) with heads of 128 and an MLP of
# 512: a rank's q (2 heads), k/v (1 KV head) and gate/up rows (256 each) are whole 128-blocks
FP8_TP_CFG = {**FP8_CFG, "head_dim": 128, "intermediate_size": 512}


@pytest.mark.parametrize("fmt", ["ct-tensor-static", "ct-channel", "fp8-block"])
def test_two_ranks_match_one_from_an_fp8_checkpoint(pair, tmp_path, fmt):
    """Each rank reads its slices of the float8 weights and of their scales (one per tensor:
    whole; per channel: a column-parallel weight's rows, whole for a row-parallel one; blocks:
    its whole blocks)."""
    fp8_dir, _ = write_pair(tmp_path, fmt, FP8_TP_CFG)
    assert pair.run(check_fp8_share, str(fp8_dir), None)
    _check_pair(pair, str(fp8_dir), torch.randint(3, 512, (20,)).tolist())


def test_two_ranks_match_one_quantized_at_load(pair, tmp_path):
    """``--quantization fp8`` of a float checkpoint: column-parallel rows quantize alike alone
    or whole; o_proj and down_proj are read whole, quantized, then cut, so that their
    per-channel scales are the whole rows' on both ranks."""
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE))
    save_checkpoint(hf, tmp_path, "5.x")
    assert pair.run(check_fp8_share, str(tmp_path), "fp8")
    _check_pair(pair, str(tmp_path), torch.randint(3, VOCAB - 3, (20,)).tolist(),
                quantization="fp8")  # fmt: skip


def test_dummy_fp8_weights_are_the_same_whatever_the_ranks(pair):
    """Each rank draws every whole tensor, quantizes it whole, and keeps its part."""
    assert pair.run(check_fp8_share, "dummy:tiny", "fp8")
    _check_pair(pair, "dummy:tiny", torch.randint(3, 500, (20,)).tolist(), quantization="fp8")


def test_the_one_shot_all_reduce_is_refused_where_it_cannot_run():
    """tp_all_reduce auto takes torch's one-shot kernel only on one host, once per process
    (torch counts a process's symmetric-memory rendezvous with one counter: a second engine's
    rank 0 would wait forever for fresh workers), and where torch has the op."""
    from flashserve.config import EngineConfig
    from flashserve.engine.parallel import one_shot_refusal

    ok = dict(ranks_share_host=True, used_before=False, has_op=True)
    assert one_shot_refusal(**ok) is None
    assert "span hosts" in one_shot_refusal(**{**ok, "ranks_share_host": False})
    assert "already" in one_shot_refusal(**{**ok, "used_before": True})
    assert "has no symm_mem" in one_shot_refusal(**{**ok, "has_op": False})
    assert EngineConfig(device="cpu").tp_all_reduce == "nccl"
    with pytest.raises(ValueError, match="tp_all_reduce must be one of"):
        EngineConfig(device="cpu", tp_all_reduce="one-shot")


def test_ranks_share_a_host_unless_torchrun_spreads_them(monkeypatch):
    from flashserve.engine.parallel import _ranks_share_host

    for var in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert _ranks_share_host(4)  # the engine started them
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not _ranks_share_host(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _ranks_share_host(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not _ranks_share_host(4)  # unknown: NCCL, which works everywhere


def test_the_fused_all_reduce_is_refused_where_it_cannot_run(monkeypatch, capsys):
    """tp_all_reduce fused (``kernels.fold``): two ranks on one host's CUDA GPUs with the
    triton backend, refused when the config is made (no worker started), in one line; never
    NCCL in its place."""
    from flashserve.cli.main import main
    from flashserve.config import EngineConfig
    from flashserve.engine.parallel import fused_refusal

    assert fused_refusal("cuda", 2, "triton", True) is None
    assert "needs CUDA GPUs" in fused_refusal("cpu", 2, "triton", True)
    assert "exactly 2 ranks, not tensor_parallel_size 4" in fused_refusal("cuda", 4, "triton", True)
    assert "triton attention backend" in fused_refusal("cuda:1", 2, "torch", True)
    assert "span hosts" in fused_refusal("cuda", 2, "triton", False)
    with pytest.raises(ValueError, match="tp_all_reduce fused needs CUDA GPUs"):
        EngineConfig(device="cpu", tensor_parallel_size=2, tp_all_reduce="fused")
    status = main(["generate", "hi", "--model", "dummy:tiny", "--device", "cpu",
                   "--tensor-parallel-size", "2", "--tp-all-reduce", "fused"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and err.strip() == (
        "flashserve generate: error: tp_all_reduce fused needs CUDA GPUs (each rank stores into "
        "the other's memory)"
    ), err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="exactly 2 ranks, not tensor_parallel_size 1"):
        EngineConfig(device="cuda", tp_all_reduce="fused", block_size=16)
    with pytest.raises(ValueError, match="triton attention backend"):
        EngineConfig(device="cuda", tensor_parallel_size=2, tp_all_reduce="fused",
                     attention_backend="torch", block_size=16)  # fmt: skip
    config = EngineConfig(device="cuda", tensor_parallel_size=2, tp_all_reduce="fused",
                          block_size=16)  # fmt: skip
    assert config.tp_all_reduce == "fused"


def test_a_group_without_the_fused_all_reduce_folds_nothing():
    from flashserve.engine.parallel import TPGroup
    from flashserve.models.sharding import SINGLE

    group = TPGroup(0, 2, torch.device("cpu"))
    assert group.fold_for(torch.zeros(1, 8)) is None
    assert SINGLE.fold_for(torch.zeros(1, 8)) is None
