"""Measuring tools: ``flashserve bench decode`` and ``flashserve bench prefill`` (in process,
beside Hugging Face transformers), ``flashserve bench serve`` (an HTTP load generator) and
``flashserve bench accuracy`` (an engine setting's outputs against a baseline's).

Nothing heavy is imported here: each command loads what it needs when it runs.
"""

from __future__ import annotations

import argparse

from flashserve.cli import args as cli


def _add_bench_args(parser: argparse.ArgumentParser) -> None:
    from flashserve.bench.accuracy import ACCURACY
    from flashserve.bench.decode import DECODE
    from flashserve.bench.prefill import PREFILL
    from flashserve.bench.serve import SERVE

    subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for cmd in (DECODE, PREFILL, SERVE, ACCURACY):
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_args(sub)
        sub.set_defaults(run=cmd.run)


def _run_bench(args: argparse.Namespace) -> int:
    # never called: the chosen benchmark's set_defaults(run=...) overrides this one
    raise cli.CLIError("choose a benchmark: decode, prefill, serve or accuracy", status=2)


BENCH = cli.Command("bench", "benchmarks: decode and prefill (in process), serve (HTTP), "
                    "accuracy (a setting against a baseline)", _add_bench_args,
                    _run_bench)  # fmt: skip
