"""``bench decode``, the peer: Hugging Face transformers on our config and our very weights.

The transformers model is built on the meta device and its parameters are set to views of
ours (q/k/v and gate/up are row slices of our fused weights), so one copy of the weights is
on the device. It decodes with a static KV cache and SDPA attention, in eager mode or, with
``compile=True``, through ``torch.compile`` (mode ``reduce-overhead``) where that works.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch
from torch import nn

from flashserve.bench.decode_ours import StepTiming
from flashserve.bench.hardware import free_memory, peak_memory, reset_peak_memory, synchronize
from flashserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 8192  # tokens per prefill forward (batch x chunk): bounds the mask and logits


class PeerUnavailable(Exception):
    """The peer cannot run this model (e.g. a RoPE variant transformers does not have)."""


def hf_config(mc: ModelConfig, dtype: torch.dtype, max_len: int):
    """The transformers config (Llama, Mistral or Qwen2) of our ModelConfig."""
    import transformers

    if mc.rope_scaling and mc.rope_scaling["rope_type"] == "freq_factors":
        raise PeerUnavailable("RoPE frequency factors (from GGUF) have no transformers config")
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }
    if mc.architecture not in classes:
        raise PeerUnavailable(f"the peer runs {', '.join(classes)}, not {mc.architecture}")
    cls = classes[mc.architecture]
    kw = dict(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        rms_norm_eps=mc.rms_norm_eps,
        max_position_embeddings=max(mc.max_position_embeddings, max_len),
        tie_word_embeddings=mc.tie_word_embeddings,
        bos_token_id=mc.bos_token_id,
        eos_token_id=mc.eos_token_ids or None,
    )
    rope = {"rope_type": "default", **(mc.rope_scaling or {}), "rope_theta": mc.rope_theta}
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers 5
        kw["rope_parameters"] = rope
    else:
        kw.update(rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling)
    if mc.architecture == "llama":
        kw["attention_bias"] = mc.attention_bias
    if mc.architecture == "mistral":
        kw["sliding_window"] = None
    config = cls(**kw)
    if int(transformers.__version__.split(".")[0]) >= 5:
        config.dtype = dtype
    else:
        config.torch_dtype = dtype
    return config


def hf_model_sharing(ours: nn.Module, mc: ModelConfig, max_len: int):
    """A transformers CausalLM whose parameters are views of ``ours`` (no copy)."""
    import transformers

    if getattr(ours, "fp8", None) is not None:
        raise PeerUnavailable("fp8 weights: transformers would run its own quantized model")
    p0 = next(ours.parameters())
    config = hf_config(mc, p0.dtype, max_len)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    slots = ours._weight_slots()
    for name, _ in list(hf.named_parameters()):
        if name == "lm_head.weight" and mc.tie_word_embeddings:
            continue
        param, start, size = slots[name][:3]
        view = param.data if size is None else param.data.narrow(0, start, size)
        _set_param(hf, name, view)
    if mc.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(p0.device)
    meta = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if meta:
        raise PeerUnavailable(f"transformers tensors left unset: {meta[:5]}")
    return hf.eval()


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


class Peer:
    """Times transformers' decode at (context, batch) points, on our weights."""

    def __init__(self, ours: nn.Module, mc: ModelConfig, max_len: int, compile: bool = False):
        self.model = hf_model_sharing(ours, mc, max_len)
        self.config = self.model.config
        self.device = next(ours.parameters()).device
        self.dtype = next(ours.parameters()).dtype
        self.kv_bytes_per_token = 2 * mc.num_hidden_layers * mc.kv_size * self.dtype.itemsize
        self.decode = self.model.forward
        # the cache's keyword: ``cache`` since transformers 5.2x, ``past_key_values`` before
        # (a deprecated alias there, to be removed in 5.40)
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.compiled = False
        self.compile_error: str | None = None
        self.warmup = 2
        if compile:
            self.decode = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
            self.compiled, self.warmup = True, 5

    def why_not(self, context: int, batch: int, steps: int) -> str | None:
        free = free_memory(self.device)
        need = batch * (context + steps + self.warmup + 1) * self.kv_bytes_per_token
        if free is not None and need > 0.9 * free:
            return f"static cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return None

    @torch.no_grad()
    def measure(self, context: int, batch: int, steps: int, gen: torch.Generator) -> StepTiming:
        """Prefill random prompts (not timed) into a fresh static cache, time ``steps``
        greedy decode steps."""
        reset_peak_memory(self.device)
        cache = self._static_cache(batch, context + self.warmup + steps + 1)
        ids = torch.randint(0, self.config.vocab_size, (batch, context), generator=gen)
        nxt = self._prefill(ids.to(self.device), cache)
        pos = context
        for i in range(self.warmup + steps):
            if i == self.warmup:
                synchronize(self.device)
                start = time.perf_counter()
            nxt = self._step(nxt, cache, pos)
            pos += 1
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        mem, kind = peak_memory(self.device)
        del cache
        kv_per_step = batch * (context + self.warmup + steps / 2 + 0.5)  # mean live length
        return StepTiming(elapsed / steps, kv_per_step, mem, kind)

    def _prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        batch, context = ids.shape
        chunk = max(1, PREFILL_TOKENS // batch)
        for s in range(0, context, chunk):
            part = ids[:, s : s + chunk]
            pos = torch.arange(s, s + part.shape[1], device=self.device)
            out = self.model(
                input_ids=part, cache_position=pos, use_cache=True, logits_to_keep=1,
                **{self.cache_kw: cache},
            )  # fmt: skip
        return out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]

    def _step(self, nxt: torch.Tensor, cache, pos: int) -> torch.Tensor:
        cpos = torch.tensor([pos], device=self.device)
        kw = {"input_ids": nxt, self.cache_kw: cache, "cache_position": cpos, "use_cache": True}
        try:
            out = self.decode(**kw)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # torch.compile failed on this version: measure eager
            if not self.compiled:
                raise
            logger.warning("torch.compile of the peer failed, running it eager: %s", exc)
            self.decode, self.compiled = self.model.forward, False
            self.compile_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            out = self.decode(**kw)
        return out.logits[:, -1].argmax(-1, keepdim=True).clone()  # [B, 1], outlives graphs

    def _static_cache(self, batch: int, max_len: int):
        from transformers import StaticCache

        params = inspect.signature(StaticCache.__init__).parameters
        kw = dict(config=self.config, max_cache_len=max_len)
        if "max_batch_size" in params:  # transformers 4
            kw.update(max_batch_size=batch, device=self.device, dtype=self.dtype)
        return StaticCache(**kw)
