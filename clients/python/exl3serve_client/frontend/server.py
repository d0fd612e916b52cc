"""`exl3serve-openai`: the OpenAI-compatible HTTP front end of an exl3serve engine.

    exl3serve-openai --engine 127.0.0.1:50051 --model MODEL_DIR --listen 127.0.0.1:8000

Serves /v1/models, /v1/completions, /v1/chat/completions (streaming and not), /health and /metrics.
Prints `openai front end listening on http://HOST:PORT/v1` once it accepts connections (with
--listen HOST:0 the port is the one the system picked).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import uvicorn

from .app import FrontendConfig, create_app


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {hostport!r}")
    return host.strip("[]"), int(port)


def _run(coro, config: uvicorn.Config) -> None:
    """Runs the server on the event loop uvicorn picks (uvloop when installed, as uvicorn.run does):
    a bare asyncio.run would run it on asyncio's pure-Python selector loop."""
    get_factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36
    if get_factory is None:
        config.setup_event_loop()  # older uvicorn: sets the event loop policy
        asyncio.run(coro)
        return
    factory = get_factory()
    if factory is None:
        asyncio.run(coro)
    elif sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(coro)
    else:
        loop = factory()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(coro)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="exl3serve-openai",
                                 description="OpenAI-compatible HTTP front end of an exl3serve "
                                             "engine (exl3-router's Generator service)")
    ap.add_argument("--engine", required=True, help="HOST:PORT of the engine's gRPC Generator")
    ap.add_argument("--model", required=True, type=Path,
                    help="model directory (tokenizer.json, tokenizer_config.json, config.json)")
    ap.add_argument("--listen", default="127.0.0.1:8000", type=_split, help="HOST:PORT to serve on")
    ap.add_argument("--served-model-name", default=None,
                    help="the model's name in the API (default: the engine's)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may take before it is answered 504")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    if not (args.model / "tokenizer.json").exists():
        print(f"exl3serve-openai: {args.model}/tokenizer.json not found (a test model gets one from "
              "exl3serve-make-tokenizer --model DIR)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper())
    app = create_app(FrontendConfig(engine=args.engine, model_dir=args.model,
                                    served_model_name=args.served_model_name,
                                    request_timeout_s=args.request_timeout))
    host, port = args.listen
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only for sockets that
    # say so, and without it small SSE writes wait for the client's delayed ACK (about 40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # uvloop does not set it on accepted connections; Linux copies it from the listening socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"openai front end listening on http://{shown}:{bound}/v1", flush=True)
        await task

    try:
        _run(serve(), config)
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
