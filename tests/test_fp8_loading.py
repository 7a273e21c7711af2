"""FP8 checkpoints load as they are, found by config.json's ``quantization_config``.

Each case writes a small Llama (hidden 320, so 128x128 blocks meet partial blocks along N and
K; q/k/v and gate/up rows in whole blocks, as fusing block scales needs) in one of the
formats, quantized here: projections F8_E4M3 beside their scales (compressed-tensors per
tensor with static ``input_scale`` and KV ``k_scale``/``v_scale`` tensors, which are skipped;
compressed-tensors per channel and 128x128 blocks; ``quant_method`` fp8 with
``weight_scale_inv``). The loaded model must equal the same model built from the dequantized
weights (float32, the torch backend: the same products exactly) in its logits and its greedy
tokens. What we cannot run is refused in one line naming the file and the field.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from model_utils import describe_diff, randomize, rel_err, run_prompts
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.loaders.errors import WeightsError
from flashserve.loaders.load import load_model
from flashserve.sampling.params import SamplingParams
from kernels.quant import E4M3, E4M3_MAX, dequantize, quantize_blocks, quantize_per_channel

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(vocab_size=512, hidden_size=320, intermediate_size=384, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
           max_position_embeddings=256)  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q_PROJ = "model.layers.0.self_attn.q_proj"

_FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True}
_TOKEN = {**_FLOAT8, "strategy": "token", "dynamic": True}


def _compressed(weights: dict, activations: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {**_FLOAT8, "dynamic": False, **weights},
             "input_activations": activations, "output_activations": None}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, **extra}  # fmt: skip


# format: (quantization_config, scale tensor suffix, how weights are quantized)
FORMATS = {
    "ct-tensor-static": (_compressed({"strategy": "tensor"},
                                     {**_FLOAT8, "strategy": "tensor", "dynamic": False},
                                     kv_cache_scheme={**_FLOAT8, "strategy": "tensor"}),
                         "weight_scale", "tensor"),
    "ct-channel": (_compressed({"strategy": "channel"}, _TOKEN), "weight_scale", "channel"),
    "ct-block": (_compressed({"strategy": "block", "block_structure": [128, 128]},
                             {**_TOKEN, "strategy": "group", "group_size": 128}),
                 "weight_scale", "block"),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, "weight_scale_inv", "block"),
}  # fmt: skip


def _quantize(w: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, the scale tensor as the format stores it)."""
    if how == "tensor":
        scale = (w.abs().max().float() / E4M3_MAX).reshape(1)
        return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale
    if how == "channel":
        q, scale = quantize_per_channel(w)
        return q, scale[:, None]  # [N, 1], as compressed-tensors stores it
    return quantize_blocks(w)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, how: str) -> torch.Tensor:
    if how == "tensor":
        return q.float() * scale
    return dequantize(q, scale.reshape(-1) if how == "channel" else scale, torch.float32)


def write_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')


def write_pair(root: Path, fmt: str, config: dict = CFG) -> tuple[Path, Path]:
    """A random Llama written twice: ``root/fp8`` in ``fmt``, ``root/ref`` its dequantized
    weights (float32, no quantization_config)."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    randomize(hf, seed=int(torch.randint(0, 2**30, ())))
    quant_config, scale_name, how = FORMATS[fmt]
    fp8, ref = {}, {}
    for name, t in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            q, scale = _quantize(t, how)
            fp8[name], fp8[f"{module}.{scale_name}"] = q, scale
            ref[name] = _dequantized(q, scale, how)
            if fmt == "ct-tensor-static":  # static activation scales: skipped on load
                fp8[f"{module}.input_scale"] = torch.tensor([0.05])
        else:
            fp8[name] = ref[name] = t.contiguous()
    if fmt == "ct-tensor-static":  # fp8 KV cache scales: skipped too
        for i in range(config["num_hidden_layers"]):
            fp8[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02)
            fp8[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03)
    plain = hf.config.to_dict()
    for sub, state, extra in (
        ("fp8", fp8, {"quantization_config": quant_config}),
        ("ref", ref, {}),
    ):
        (root / sub).mkdir()
        save_file(state, root / sub / "model.safetensors", metadata={"format": "pt"})
        (root / sub / "config.json").write_text(json.dumps({**plain, **extra}))
        write_tokenizer(root / sub)
    return root / "fp8", root / "ref"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_its_dequantized_model(tmp_path, fmt):
    fp8_dir, ref_dir = write_pair(tmp_path, fmt)
    ours = load_model(str(fp8_dir), "cpu", torch.float32, "torch").model
    ref = load_model(str(ref_dir), "cpu", torch.float32, "torch").model
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.weight_scale.dtype == torch.float32
    assert ours.fp8.scales == ("block" if "block" in fmt else "channel")
    assert ours.lm_head.weight.dtype == ours.model.embed_tokens.weight.dtype == torch.float32
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (1, 9, 33)]
    for o, r in zip(run_prompts(ours, prompts), run_prompts(ref, prompts)):
        assert rel_err(o, r) < 1e-6, describe_diff(o, r)


@pytest.mark.parametrize("fmt", ["ct-tensor-static", "fp8-block"])
def test_fp8_checkpoint_greedy_tokens_equal_the_dequantized_model(tmp_path, fmt):
    """Through the engine, with and without ``--quantization fp8`` (an fp8 checkpoint needs
    no flag, and the flag does not re-quantize it)."""
    fp8_dir, ref_dir = write_pair(tmp_path, fmt)
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (4, 17)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    got = {}
    for name, path, quant in (("ref", ref_dir, None), ("fp8", fp8_dir, None),
                              ("fp8+flag", fp8_dir, "fp8")):  # fmt: skip
        llm = LLM(EngineConfig(model=str(path), quantization=quant, max_kv_tokens=1024))
        got[name] = [c.token_ids for c in llm.generate(prompts, params)]
    assert got["fp8"] == got["ref"] == got["fp8+flag"]


def test_a_float_projection_in_an_fp8_checkpoint_is_quantized_at_load(tmp_path):
    """A layer the checkpoint left unquantized (its ``ignore`` list) loads quantized per
    channel, like ``--quantization fp8`` does; every other one as stored."""
    fp8_dir, _ = write_pair(tmp_path, "ct-channel")
    state = load_file(fp8_dir / "model.safetensors")
    down = "model.layers.1.mlp.down_proj"
    w = torch.randn(CFG["hidden_size"], CFG["intermediate_size"]) * 0.05
    state[f"{down}.weight"] = w
    del state[f"{down}.weight_scale"]
    save_file(state, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    model = load_model(str(fp8_dir), "cpu", torch.float32, "torch").model
    linear = model.get_submodule(down)
    torch.testing.assert_close(linear.weight_scale, w.abs().amax(1) / E4M3_MAX)
    assert torch.equal(
        linear.weight.view(torch.uint8), quantize_per_channel(w)[0].view(torch.uint8)
    )
    q_rows = model.model.layers[0].self_attn.qkv_proj.weight[: CFG["num_attention_heads"] * 64]
    assert torch.equal(q_rows.view(torch.uint8), state[f"{Q_PROJ}.weight"].view(torch.uint8))


def test_fused_block_parts_must_be_whole_blocks(tmp_path):
    """q (4 heads of 32 = 128 rows) then k (2 x 32 = 64) then v: k's block scales would share
    a block with v's. Refused before any allocation, naming config.json."""
    small = {**CFG, "head_dim": 32}
    fp8_dir, _ = write_pair(tmp_path, "fp8-block", small)
    with pytest.raises(WeightsError, match=r"config\.json: .*need k_proj's rows in whole blocks "
                                           r"of 128 .*it has 64"):  # fmt: skip
        load_model(str(fp8_dir), "cpu", torch.float32, "torch")


# ---- refused ---------------------------------------------------------------------------------

CT = FORMATS["ct-channel"][0]
GROUP = CT["config_groups"]["group_0"]


def _group(**changes) -> dict:
    return {**CT, "config_groups": {"group_0": {**GROUP, **changes}}}


# name: (quantization_config, the field the message names)
REFUSED_CONFIGS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    "int4-weights": (_group(weights={**GROUP["weights"], "num_bits": 4, "type": "int"}),
                     "config_groups.group_0.weights.num_bits 4"),
    "int8-weights": (_group(weights={**GROUP["weights"], "type": "int"}),
                     "config_groups.group_0.weights.type 'int'"),
    "int8-activations": (_group(input_activations={**_TOKEN, "type": "int"}),
                         "config_groups.group_0.input_activations.type 'int'"),
    "group-activations": (_group(input_activations={**_TOKEN, "strategy": "group",
                                                    "group_size": 128}),
                          "config_groups.group_0.input_activations.strategy 'group'"),
    "block-64": (_group(weights={**GROUP["weights"], "strategy": "block",
                                 "block_structure": [64, 64]}),
                 r"config_groups.group_0.weights.block_structure \[64, 64\]"),
    "mixed-groups": ({**CT, "config_groups": {
        "group_0": GROUP, "group_1": FORMATS["ct-block"][0]["config_groups"]["group_0"]}},
        "config_groups 'group_0: channel, group_1: block'"),
    "packed": ({**CT, "format": "pack-quantized"}, "format 'pack-quantized'"),
    "fp8-block-64": ({**FORMATS["fp8-block"][0], "weight_block_size": [64, 64]},
                     r"weight_block_size \[64, 64\]"),
    "fp8-e5m2": ({**FORMATS["fp8-block"][0], "fmt": "e5m2"}, "fmt 'e5m2'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_unsupported_quantization_configs_are_refused_in_one_line(tmp_path, case):
    """Before the tokenizer or any weight is read: config.json alone suffices."""
    quant, field = REFUSED_CONFIGS[case]
    config = {**transformers.LlamaConfig(**CFG).to_dict(), "quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as info:
        load_model(str(tmp_path), "cpu", torch.float32, "torch", quantization="fp8")
    line = str(info.value)
    assert info.value.file == tmp_path / "config.json" and "\n" not in line
    assert re.search(rf"quantization_config\.{field} is not supported", line), line
    assert "supported: compressed-tensors float8 weights" in line


def _edit(path: Path, fn) -> None:
    state = load_file(path / "model.safetensors")
    fn(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _drop_q_scale(s):
    del s[f"{Q_PROJ}.weight_scale"]


def _bad_q_scale(s):
    s[f"{Q_PROJ}.weight_scale"] = torch.ones(7, 1)


def _e5m2_weight(s):
    s[f"{Q_PROJ}.weight"] = s[f"{Q_PROJ}.weight"].float().to(torch.float8_e5m2)


def _fp8_embeddings(s):
    s["model.embed_tokens.weight"] = s["model.embed_tokens.weight"].to(E4M3)


# name: (break the ct-channel checkpoint, the problem (a regex)); the message names the file
# being read, or the directory for what is missing once all are read
REFUSED_TENSORS = {
    "scale-missing": (_drop_q_scale, rf"1 missing: {Q_PROJ}\.weight_scale"),
    "scale-shape": (_bad_q_scale, rf"tensor {Q_PROJ}\.weight_scale: checkpoint shape \(7, 1\), "
                                  r"model expects one value, \(256,\) or \(256, 1\)"),
    "e5m2-weight": (_e5m2_weight, rf"tensor {Q_PROJ}\.weight is F8_E5M2: float8 weights other "
                                  "than e4m3 are not supported"),
    "fp8-embeddings": (_fp8_embeddings, "tensor model.embed_tokens.weight is torch.float8_e4m3fn: "
                                        "only the decoder's projections take float8 weights"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_TENSORS))
def test_broken_fp8_checkpoints_name_the_file_and_the_tensor(tmp_path, case):
    breaks, problem = REFUSED_TENSORS[case]
    fp8_dir, _ = write_pair(tmp_path, "ct-channel")
    _edit(fp8_dir, breaks)
    with pytest.raises(WeightsError) as info:
        load_model(str(fp8_dir), "cpu", torch.float32, "torch")
    file = fp8_dir if case == "scale-missing" else fp8_dir / "model.safetensors"
    assert info.value.file == file
    assert re.search(problem, info.value.problem), info.value.problem


def _generate_fails(path: Path) -> str:
    """``flashserve generate`` on ``path``: exit status 1, no traceback, one line on stderr
    besides log records; that line."""
    cmd = [sys.executable, "-m", "flashserve", "generate", "w5 w6", "--model", str(path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO ")]
    assert len(lines) == 1 and "cannot load the model" in lines[0], r.stderr
    return lines[0]


def test_the_command_line_refuses_in_one_line(tmp_path):
    """An AWQ config.json, and an fp8 checkpoint that lacks a scale: ``generate`` prints the
    file and the problem."""
    (tmp_path / "awq").mkdir()
    config = {**transformers.LlamaConfig(**CFG).to_dict(),
              "quantization_config": REFUSED_CONFIGS["awq"][0]}  # fmt: skip
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    line = _generate_fails(tmp_path / "awq")
    assert f"{tmp_path / 'awq' / 'config.json'}: quantization_config.quant_method 'awq'" in line
    fp8_dir, _ = write_pair(tmp_path, "ct-channel")
    _edit(fp8_dir, _drop_q_scale)
    line = _generate_fails(fp8_dir)
    assert (
        f"{fp8_dir}: checkpoint does not match the model; 1 missing: {Q_PROJ}.weight_scale" in line
    )
