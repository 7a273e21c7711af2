"""The ``flashserve`` console script: ``serve`` lives here, every other command in
``flashserve/cli.py`` (the engine package must not import the server)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from flashserve import cli

logger = logging.getLogger("flashserve.serve")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 for every interface, as the Docker image does)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--raw-prompts",
        action="store_true",
        help="pass /generate inputs to the model as they are; by default plain text sent to a "
        "chat model is wrapped in its chat template as one user message",
    )
    cli.add_engine_args(parser)


def _run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flashserve.async_llm import AsyncLLM
    from server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = cli.engine_config_from_args(args)
    logger.info(
        "loading %s on %s (%s)", config.model or "the default model", config.device, config.dtype
    )
    llm = cli.load_engine(AsyncLLM, config)  # before uvicorn: a bad --model is a plain error
    app = build_app(llm=llm, raw_prompts=args.raw_prompts)
    # open streams would hold a shutdown forever: give them 5 s, then close them
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


SERVE = cli.Command(
    "serve", "serve the text-generation-inference HTTP API", _add_serve_args, _run_serve
)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, extra_commands=[SERVE])
