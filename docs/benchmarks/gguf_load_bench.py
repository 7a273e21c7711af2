"""How long a big GGUF checkpoint takes to load: a file with a preset's shapes (default
``llama3.1-8b``, plain RoPE), its projections, embeddings and LM head stored as ``--type``
(default Q4_K) of random bytes, its norms float32 ones, a byte-level vocabulary of the preset's
size; then ``load_model`` of it on ``--device`` in bfloat16, timed from the call to its return.

    python3 docs/benchmarks/gguf_load_bench.py write FILE [--preset llama3.1-8b] [--type Q4_K]
    python3 docs/benchmarks/gguf_load_bench.py load FILE [--device cuda]

The weights are random bit patterns (float16 scales among them inf or NaN): a timing, not a
model to run. Run ``load`` from another tree (``PYTHONPATH=that/tree``) to time its loader on
the same file; a file just written is in the page cache, so neither run waits on the disk.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from flashserve.loaders.load import load_model
from flashserve.models.presets import preset_config
from flashserve.tokenizer.gguf import byte_alphabet

Q = gguf.GGMLQuantizationType
LAYER = {"attn_q": ("heads", "hidden"), "attn_k": ("kv", "hidden"), "attn_v": ("kv", "hidden"),
         "attn_output": ("hidden", "heads"), "ffn_gate": ("inter", "hidden"),
         "ffn_up": ("inter", "hidden"), "ffn_down": ("hidden", "inter")}  # fmt: skip


def write(path: str, preset: str, qtype: Q) -> None:
    c = preset_config(preset)
    dims = {"hidden": c.hidden_size, "inter": c.intermediate_size,
            "heads": c.num_attention_heads * c.head_dim,
            "kv": c.num_key_value_heads * c.head_dim}  # fmt: skip
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)

    def packed(rows: int, cols: int) -> np.ndarray:
        n = rows * cols // block * block_bytes
        return np.frombuffer(rng.bytes(n), np.uint8).reshape(rows, -1)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{preset}-random-{qtype.name}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = [*byte_alphabet().values(), "<s>", "</s>"]
    tokens += [f"<x{i}>" for i in range(c.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [4] * (c.vocab_size - 258))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    ones = np.ones(c.hidden_size, np.float32)
    w.add_tensor("token_embd.weight", packed(c.vocab_size, c.hidden_size), raw_dtype=qtype)
    for i in range(c.num_hidden_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, (rows, cols) in LAYER.items():
            w.add_tensor(f"blk.{i}.{name}.weight", packed(dims[rows], dims[cols]), raw_dtype=qtype)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", packed(c.vocab_size, c.hidden_size), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load(path: str, device: str) -> None:
    start = time.perf_counter()
    loaded = load_model(path, device, torch.bfloat16, "torch")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weights = sum(p.numel() for p in loaded.model.parameters())
    print(f"load_model {path} on {device}: {seconds:.2f} s ({weights / 1e9:.2f}e9 weights)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["write", "load"])
    ap.add_argument("file")
    ap.add_argument("--preset", default="llama3.1-8b")
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.what == "write":
        write(args.file, args.preset, Q[args.type])
    else:
        load(args.file, args.device)


if __name__ == "__main__":
    main()
