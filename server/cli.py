"""The ``flashserve`` console script: ``serve`` lives here, every other command in
``flashserve/cli/`` (the engine package must not import the server)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from flashserve.cli import args as cli
from flashserve.cli.main import main as engine_main
from server.settings import BYTES_PER_CONTEXT_TOKEN, ServerSettings

logger = logging.getLogger("flashserve.serve")
API_KEY_ENV = "FLASHSERVE_API_KEY"


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
    _add_production_args(parser.add_argument_group("production"))
    cli.add_engine_args(parser)


def _add_production_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        help="generations run at once (a request with n choices counts n; default: no limit)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=0,
        help="requests that may wait for a free slot; past both limits a request "
        "gets 429 at once (default: 0)",
    )
    g.add_argument(
        "--queue-timeout",
        type=float,
        default=60.0,
        help="seconds a request may wait in that queue before a 503 (default: 60)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        help="the largest body a generation request may have; past it, 413 at once "
        f"(default: {BYTES_PER_CONTEXT_TOKEN} bytes per token of the context, at least 1 MiB)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's whole body; past them, 408 (default: 30)",
    )
    g.add_argument(
        "--max-choices-per-request",
        type=int,
        default=256,
        help="completions one request may ask for (OpenAI routes: prompts x n; each is an "
        "engine request and takes a concurrency slot) (default: 256)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds that requests in flight get to finish; streams still open "
        "then end with an error event (default: 30)",
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds without engine progress, while requests are pending, after "
        "which /health answers 503 (default: 120)",
    )
    g.add_argument(
        "--dead-exit-delay",
        type=float,
        default=10.0,
        help="seconds the server stays up once the engine is dead (health 503), then it exits "
        "with status 1 for a supervisor to restart it; negative: never exit (default: 10)",
    )
    g.add_argument(
        "--api-key",
        help=f"require Authorization: Bearer KEY on every route but /health, /ready "
        f"and /metrics (default: ${API_KEY_ENV}, else no key)",
    )
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        help="CORS origins, comma-separated or repeated (default: no CORS)",
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The server settings; the API key comes from --api-key, else $FLASHSERVE_API_KEY."""
    origins = [o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip()]
    try:
        return ServerSettings(
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            queue_timeout=args.queue_timeout,
            max_request_bytes=args.max_request_bytes,
            request_read_timeout=args.request_read_timeout,
            max_choices_per_request=args.max_choices_per_request,
            shutdown_timeout=args.shutdown_timeout,
            stall_timeout=args.stall_timeout,
            dead_exit_delay=args.dead_exit_delay if args.dead_exit_delay >= 0 else None,
            api_key=_api_key(args),
            allowed_origins=tuple(origins),
        )
    except ValueError as exc:
        raise cli.CLIError(str(exc), status=2) from exc


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $FLASHSERVE_API_KEY, without surrounding whitespace (a key read from a
    file or a secret store often ends with a newline, which no client sends); None when
    neither is set. One set but blank is refused: the server would otherwise run open, or
    with a key no client can send."""
    source, key = "--api-key", args.api_key
    if key is None:
        source, key = f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise cli.CLIError(f"the API key ({source}) is empty or only whitespace", status=2)
    return None if key is None else key.strip()


def _run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flashserve.engine.core_client import CoreStartupError, EngineCoreClient
    from server.app import build_app
    from server.shutdown import DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = cli.engine_config_from_args(args)
    cli.serve_if_torchrun_worker(config)  # ranks > 0 under torchrun: no HTTP, rank 0's steps
    settings = settings_from_args(args)
    logger.info(
        "loading %s on %s (%s)", config.model or "the default model", config.device, config.dtype
    )
    # the engine core process loads the model before uvicorn starts: a bad --model is a plain
    # error, with the same message and status as when the engine ran in this process
    try:
        llm = EngineCoreClient(config, log_level=logging.getLogger().getEffectiveLevel())
    except CoreStartupError as exc:
        raise cli.model_error(config, exc) from exc
    app = build_app(llm=llm, raw_prompts=args.raw_prompts, settings=settings)
    # the drain (DrainingServer) lets requests finish; what is still open after it gets 2 s
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=2
    )
    server = DrainingServer(uvicorn_config, app, settings.shutdown_timeout)
    server.run()
    return server.exit_status


SERVE = cli.Command(
    "serve", "serve the text-generation-inference HTTP API", _add_serve_args, _run_serve
)


def main(argv: Sequence[str] | None = None) -> int:
    return engine_main(argv, extra_commands=[SERVE])
