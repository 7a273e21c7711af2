"""``flashserve bench accuracy``: how far an engine setting's outputs are from a baseline's.

The setting is the engine as the options given configure it (every option of
``add_engine_args``, e.g. ``--kv-cache-dtype fp8``); the baseline is the same options with the
fields of ``BASELINE_RESETS`` (the KV cache's dtype, and weight quantization where the config
has it) back at their defaults, changed further by ``--baseline FIELD=VALUE``. The two engines
run one after the other (a GPU need not hold both), each measured two ways:

- teacher forcing over a fixed text that ships with the package (``eval_text.md``: the
  project's README and two of its docs as they stood on 2026-11-24, frozen so that numbers
  from different commits compare; ``--text`` to choose others), its first ``--tokens`` tokens
  prefilled as one sequence through the engine's normal path (``LLMEngine.prompt_logits``:
  chunks of the step budget, the K/V written to the cache in its dtype and read back by the
  attention). Per position ``i`` (predicting token ``i + 1``): whether both engines' argmax
  agree, ``KL(baseline || setting)`` of the two next-token distributions (nats), and each
  engine's log-likelihood of the text's token, whence its perplexity ``exp(mean NLL)``;
- greedy generation (``temperature 0``, ``--max-new-tokens``) of ``--prompts`` fixed prompts
  (``prompts``: tasks x subjects, through the chat template when the model has one): how many
  outputs match the baseline's exactly, and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from flashserve.bench.report import publish, run_metadata, table
from flashserve.cli import args as cli
from flashserve.config import EngineConfig

# fields the baseline takes at their defaults: the settings being measured
BASELINE_RESETS = ("kv_cache_dtype", "quantization")
# README.md, docs/gpu-checks.md and docs/benchmarks/kernels.md at commit fa9f010, joined by
# blank lines: English and technical prose of our own, fixed (the live files change)
DEFAULT_TEXT = Path(__file__).with_name("eval_text.md")
TASKS = (
    "Explain in a few sentences how {} works.",
    "Write a short story about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
    "Describe {} to a ten-year-old.",
    "Write a poem about {}.",
    "What are the pros and cons of {}?",
    "Give me a recipe that involves {}.",
    "Summarize the main ideas behind {}.",
    "Why do people care about {}?",
)
SUBJECTS = ("the moon", "a steam engine", "bees", "the Roman Empire", "rain", "chess",
            "the internet", "volcanoes", "jazz", "bread")  # fmt: skip


def prompts(n: int) -> list[str]:
    """The first ``n`` of the fixed prompts (at most ``len(TASKS) * len(SUBJECTS)``), subjects
    varying fastest."""
    every = [t.format(s) for t, s in itertools.product(TASKS, SUBJECTS)]
    if not 0 <= n <= len(every):
        raise ValueError(f"--prompts must be in [0, {len(every)}], got {n}")
    return every[:n]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", action="append", metavar="FILE",
                        help="the teacher-forced text, these files concatenated (default: "
                        f"{DEFAULT_TEXT.name}, shipped with flashserve)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=4096,
                        help="teacher-forced tokens, the text's first (default 4096)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=50, help="greedy prompts (default 50)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens generated per greedy prompt (default 64)")  # fmt: skip
    parser.add_argument("--baseline", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field of the baseline, on top of the setting's "
                        f"options with {', '.join(BASELINE_RESETS)} at their defaults "
                        "(e.g. --baseline dtype=float32)")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    cli.add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2 or args.max_new_tokens < 1:
        raise cli.CLIError("--tokens must be >= 2 and --max-new-tokens >= 1", status=2)
    try:
        texts = prompts(args.prompts)
    except ValueError as exc:
        raise cli.CLIError(str(exc), status=2) from exc
    setting, baseline = engine_configs(args)
    files, text = read_text(args.text)
    base = measure(baseline, text, args.tokens, texts, args.max_new_tokens)
    ours = measure(setting, text, args.tokens, texts, args.max_new_tokens, against=base)
    result = {
        "meta": {
            **run_metadata(),
            "model": ours["model"],
            "device": setting.device,
            "setting": config_diff(setting, baseline),
            "baseline": config_diff(baseline, setting),
            "setting_config": dataclasses.asdict(setting),
            "text_files": files,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "max_new_tokens": args.max_new_tokens,
        },
        "teacher_forced": ours["teacher_forced"],
        "greedy": ours["greedy"],
        "kv_cache": {"baseline": base["kv_cache"], "setting": ours["kv_cache"]},
    }
    publish(result, format_result(result), args.json)
    return 0


def engine_configs(args: argparse.Namespace) -> tuple[EngineConfig, EngineConfig]:
    """(setting, baseline): the options given, and the same with ``BASELINE_RESETS`` at their
    defaults and ``--baseline`` applied; CLIError (status 2) for a field or value that is
    not one."""
    setting = cli.engine_config_from_args(args)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    given = {n: getattr(args, n) for n in fields if getattr(args, n, None) is not None}
    for name in BASELINE_RESETS:
        given.pop(name, None)
    for item in args.baseline:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise cli.CLIError(f"--baseline {item!r}: not FIELD=VALUE with an EngineConfig "
                               "field", status=2)  # fmt: skip
        given[name] = _value(value.strip())
    try:
        return setting, EngineConfig(**given)
    except (TypeError, ValueError) as exc:
        raise cli.CLIError(f"--baseline: {exc}", status=2) from exc


def _value(text: str) -> Any:
    """A field's value from its text: none, true/false, an int, a float, else the text."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def config_diff(a: EngineConfig, b: EngineConfig) -> dict[str, Any]:
    """The fields of ``a`` that differ from ``b``'s."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return {k: v for k, v in da.items() if db.get(k) != v}


def read_text(files: list[str] | None) -> tuple[list[str], str]:
    """The teacher-forced text: ``files`` concatenated (blank lines between), by default
    ``DEFAULT_TEXT``."""
    paths = [Path(f) for f in files] if files else [DEFAULT_TEXT]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise cli.CLIError(f"no text file {missing[0]}", status=2)
    return [str(p) for p in paths], "\n\n".join(p.read_text() for p in paths)


def measure(config: EngineConfig, text: str, tokens: int, texts: list[str], max_new: int,
            against: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One engine's run: teacher forcing over the first ``tokens`` tokens of ``text`` and
    greedy outputs of ``texts``. Without ``against`` (the baseline) the log-probabilities and
    outputs are kept; with it, compared to its. The engine is freed at the end."""
    from flashserve.engine.llm_engine import LLM
    from flashserve.sampling.params import SamplingParams

    llm = cli.load_engine(LLM, config)
    try:  # (no other name for the engine or its runner here: the baseline's KV pool, sized
        # from free memory, must be gone before the setting's engine sizes its own)
        out = {
            "model": llm.engine.model_name,
            "ids": llm.tokenizer.encode(text)[: min(tokens, llm.engine.max_model_len - 1)],
            "kv_cache": {
                "dtype": config.kv_cache_dtype,
                "tokens": llm.engine.runner.num_kv_tokens,
                "gib": llm.engine.runner.kv_cache_bytes / 2**30,
            },  # fmt: skip
        }
        if against is not None and out["ids"] != against["ids"]:
            raise cli.CLIError("the two engines tokenize the text differently: compare "
                               "settings of one model")  # fmt: skip
        chunks = (torch.log_softmax(x.float(), -1).cpu()
                  for x in llm.engine.prompt_logits(out["ids"]))  # fmt: skip
        if against is None:
            out["logprobs"] = torch.cat(list(chunks))  # [T, V] float32, on the host
        else:
            out["teacher_forced"] = compare_logprobs(against["logprobs"], chunks, out["ids"])
        greedy_ids = [_prompt_ids(llm.tokenizer, t) for t in texts]
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        outputs = [c.token_ids for c in llm.generate(greedy_ids, params)] if texts else []
    finally:
        llm.close()  # its tensor-parallel workers, if any
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if against is None:
        return {**out, "outputs": outputs}
    return {**out, "greedy": compare_outputs(against["outputs"], outputs)}


def _prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt's ids: through the chat template when the model has one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def compare_logprobs(base: torch.Tensor, chunks: Iterable[torch.Tensor],
                     ids: list[int]) -> dict[str, Any]:  # fmt: skip
    """Teacher-forcing statistics of the setting's log-probabilities (``chunks`` of rows, in
    position order) against the baseline's ``base`` [T, V]: positions 0 .. T-2, each
    predicting the next token of ``ids``."""
    n = len(ids) - 1
    target = torch.tensor(ids[1:])
    agree, kl, nll_b, nll_s, start = 0, [], 0.0, 0.0, 0
    for ls in chunks:
        rows = min(ls.shape[0], n - start)
        if rows <= 0:
            break
        lb, ls, t = base[start : start + rows], ls[:rows], target[start : start + rows]
        agree += int((lb.argmax(-1) == ls.argmax(-1)).sum())
        kl.append((lb.exp() * (lb - ls)).sum(-1).double())
        nll_b -= float(lb.gather(1, t[:, None]).double().sum())
        nll_s -= float(ls.gather(1, t[:, None]).double().sum())
        start += rows
    kl_all = torch.cat(kl)
    ppl_b, ppl_s = math.exp(nll_b / n), math.exp(nll_s / n)
    return {
        "positions": n,
        "argmax_agreement": agree / n,
        "kl_mean": float(kl_all.mean()),
        "kl_p99": float(kl_all.quantile(0.99)),
        "kl_max": float(kl_all.max()),
        "perplexity_baseline": ppl_b,
        "perplexity_setting": ppl_s,
        "perplexity_change_percent": 100 * (ppl_s / ppl_b - 1),
    }


def compare_outputs(base: list[list[int]], ours: list[list[int]]) -> dict[str, Any]:
    """Greedy outputs against the baseline's: exact matches, the common prefix's length."""
    prefixes = [_common_prefix(a, b) for a, b in zip(base, ours)]
    n = len(base)
    return {
        "prompts": n,
        "exact_matches": sum(a == b for a, b in zip(base, ours)),
        "mean_common_prefix": sum(prefixes) / n if n else None,
        "mean_length_baseline": sum(map(len, base)) / n if n else None,
        "mean_length_setting": sum(map(len, ours)) / n if n else None,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_result(result: dict[str, Any]) -> str:
    meta, tf, g = result["meta"], result["teacher_forced"], result["greedy"]
    kv = result["kv_cache"]
    head = (f"{meta['model']} on {meta['device']}: setting {meta['setting'] or '(same)'} "
            f"against baseline {meta['baseline'] or '(same)'}")  # fmt: skip
    forced = table(
        ["positions", "argmax agree %", "KL mean", "KL p99", "KL max", "ppl base", "ppl setting",
         "ppl change %"],
        [[tf["positions"], 100 * tf["argmax_agreement"], tf["kl_mean"], tf["kl_p99"],
          tf["kl_max"], tf["perplexity_baseline"], tf["perplexity_setting"],
          tf["perplexity_change_percent"]]],
    )  # fmt: skip
    greedy = table(
        ["prompts", "exact", "mean common prefix", "mean len base", "mean len setting"],
        [[g["prompts"], g["exact_matches"], g["mean_common_prefix"], g["mean_length_baseline"],
          g["mean_length_setting"]]],
    )  # fmt: skip
    pools = ", ".join(f"{k} {v['dtype']} {v['tokens']:,} tokens ({v['gib']:.2f} GiB)"
                      for k, v in kv.items())  # fmt: skip
    return "\n".join([head, "", "teacher forced:", forced, "", "greedy:", greedy, "",
                      f"KV pools: {pools}"])  # fmt: skip


ACCURACY = cli.Command("accuracy", "an engine setting's outputs against a baseline's (KL, "
                       "perplexity, greedy matches)", add_args, run)  # fmt: skip
