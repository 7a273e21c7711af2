"""The entry point: ``flashserve COMMAND``, with the engine's own commands (``generate``,
``bench``) and those a caller adds (``server/cli.py`` adds ``serve``, so that this package never
imports the server)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import flashserve
from flashserve.bench import BENCH
from flashserve.cli.args import CLIError, Command
from flashserve.cli.generate import GENERATE


def build_parser(extra_commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashserve", description=flashserve.__doc__)
    parser.add_argument("--version", action="version", version=flashserve.__version__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in (*extra_commands, GENERATE, BENCH):
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_args(sub)
        sub.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None, extra_commands: Sequence[Command] = ()) -> int:
    args = build_parser(extra_commands).parse_args(argv)
    try:
        return args.run(args)
    except CLIError as exc:
        print(f"flashserve {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
