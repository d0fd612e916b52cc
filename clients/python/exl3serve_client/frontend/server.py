"""`exl3serve-openai`: the OpenAI-compatible HTTP front end of an exl3serve engine.

    exl3serve-openai --engine 127.0.0.1:50051 --model MODEL_DIR --listen 127.0.0.1:8000

Serves /v1/models, /v1/completions, /v1/chat/completions (streaming and not), /tokenize,
/detokenize, /health and /metrics (docs/frontend.md).
Prints `openai front end listening on http://HOST:PORT/v1` once it accepts connections (with
--listen HOST:0 the port is the one the system picked). With --workers N it is N processes on
the address under a supervising parent (frontend/workers.py); SIGTERM or SIGINT drains
them (or the one process) and exits 0. Each process sends its requests to the engine on one
GenerateStream call (--engine-calls stream, the default) or one Generate call each (per-request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import uvicorn
from uvicorn.config import LOGGING_CONFIG


from ..package_version import package_version
from .access import API_KEY_ENV
from .log_format import LOG_FORMATS, LogFormat, configure_logging
from .stats_log import DEFAULT_LOG_STATS_INTERVAL_S
from .app import (DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES, ENGINE_CALLS, CorsConfig,
                  FrontendConfig, create_app)
from .reasoning import REASONING_PARSERS
from .tool_calls import TOOL_CALL_PARSERS
from .workers import Supervisor, WorkerArgv, exit_with_parent, say_serving


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


# uvicorn's graceful shutdown: on SIGTERM/SIGINT open streams get this long to finish.
GRACEFUL_SHUTDOWN_S = 5
# The answers still under way this long before uvicorn would cancel them (and cut their
# connections) are ended by the front end: a stream with an error event and [DONE], a whole
# answer with a 503 (Engine.end_open_calls).
END_ANSWERS_BEFORE_S = 1.0


def _workers(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {text!r}")
    return n


def _bytes(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of bytes >= 1, got {text!r}")
    return n


def _positive_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = 0.0
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return s


def _positive(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return n


def _reasoning_parser(text: str) -> str:
    if text not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"no reasoning parser {text!r}: the parsers are "
                                         f"{', '.join(REASONING_PARSERS)}")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0 to 65535), got {text!r}")
    return int(text)


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's --allowed-origins takes it: '["http://a.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="exl3serve-openai",
                                 description="OpenAI-compatible HTTP front end of an exl3serve "
                                             "engine (exl3-router's Generator service)")
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    ap.add_argument("--engine", required=True, help="HOST:PORT of the engine's gRPC Generator")
    ap.add_argument("--model", required=True, type=Path,
                    help="model directory (tokenizer.json, tokenizer_config.json, config.json)")
    ap.add_argument("--listen", default="127.0.0.1:8000", type=_split, help="HOST:PORT to serve on")
    ap.add_argument("--host", default=None, help="the host to serve on (replaces --listen's)")
    ap.add_argument("--port", default=None, type=_port, help="the port to serve on (replaces "
                    "--listen's)")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                    help="the key clients must send as 'Authorization: Bearer KEY' on the API's "
                         "routes (/v1/..., /tokenize, /detokenize; /health and /metrics stay "
                         f"open); a request without it is answered 401. Default: ${API_KEY_ENV} "
                         "(which keeps the key out of the process list); neither: no key")
    ap.add_argument("--allowed-origins", type=_json_strings, default=None,
                    help="CORS: the origins browsers may call from, a JSON list "
                         "('[\"https://app.example\"]', '[\"*\"]'); default: none (no CORS "
                         "headers; vLLM's default is [\"*\"])")
    ap.add_argument("--allowed-methods", type=_json_strings, default=["*"],
                    help="CORS: the methods allowed, a JSON list (default [\"*\"])")
    ap.add_argument("--allowed-headers", type=_json_strings, default=["*"],
                    help="CORS: the request headers allowed, a JSON list (default [\"*\"])")
    ap.add_argument("--allow-credentials", action="store_true",
                    help="CORS: allow credentials (cookies, Authorization)")
    ap.add_argument("--max-model-len", type=_positive, default=None,
                    help="tokens of prompt and completion together at most, per request (a "
                         "request that asks for more is refused 400); at most the engine's "
                         "context (a larger one stops the front end at start). Default: the "
                         "engine's context")
    ap.add_argument("--disable-access-log", action="store_true",
                    help="no line per request on stderr")
    ap.add_argument("--served-model-name", default=None,
                    help="the model's name in the API (default: the engine's)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may take before it is answered 504")
    ap.add_argument("--workers", type=_workers, default=1,
                    help="front-end processes serving --listen, each with its own event loop and "
                         "gRPC channel, supervised by this one (restarted if one dies; /metrics "
                         "sums them all). Default 1: one process, no supervisor; the front end "
                         "shares its host with the engine, and one event loop keeps up to about "
                         "8 concurrent streams with no queueing of their first tokens. At 32 and "
                         "more concurrent streams a new request's first token waits behind the "
                         "other streams' chunks: give 2-4 (bench/results/frontend.md)")
    ap.add_argument("--engine-calls", choices=ENGINE_CALLS, default="stream",
                    help="how requests reach the engine: stream (default) puts every request of a "
                         "process on one Generator.GenerateStream call, which sends one message per "
                         "engine step for all of them; per-request makes one Generator.Generate "
                         "call per request (one message per request per step; also for an engine "
                         "that predates GenerateStream)")
    ap.add_argument("--max-request-body-bytes", type=_bytes,
                    default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                    help="the largest request body taken, in bytes; a larger one is answered 413 "
                         "(OpenAI's error body, code request_too_large) after it is read and "
                         f"dropped (default {DEFAULT_MAX_REQUEST_BODY_BYTES}: 16 MiB, a "
                         "million-token prompt as token ids)")
    ap.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                    help="the format of the model's tool calls, parsed into OpenAI's tool_calls "
                         "(vLLM's names): hermes (Qwen's <tool_call> JSON), glm45 (GLM-4.5's "
                         "<arg_key>/<arg_value> tags), qwen3_coder or qwen3_xml (Qwen3-Coder's "
                         "<function=…>/<parameter=…> tags), deepseek_v3 / deepseek_v31 (DeepSeek-V3's / "
                         "V3.1's <｜tool▁call▁begin｜> tags), deepseek_v4 / deepseek_v32 "
                         "(DeepSeek-V4's / V3.2's DSML), or auto (default): the one the "
                         "model's chat template writes; a model whose template has none refuses tools "
                         "(400) unless tool_choice is none")
    ap.add_argument("--reasoning-parser", type=_reasoning_parser, default=None,
                    help="split the model's reasoning from its answer (vLLM's names): glm45 and "
                         "qwen3 (an output that opens with <think>: the text up to </think> is "
                         "the message's reasoning_content), deepseek_r1 (the output starts inside "
                         "the reasoning, its <think> in the prompt), deepseek_v4 (DeepSeek-V4: "
                         "deepseek_r1's rule in thinking mode, glm45's in chat mode, the mode from "
                         "the request's chat_template_kwargs thinking / enable_thinking, thinking "
                         "unless they are false). Default: none, the reasoning "
                         "stays in the content and include_reasoning is refused")
    ap.add_argument("--max-n", type=_positive, default=DEFAULT_MAX_N,
                    help=f"the most choices (n) one request may ask for (default {DEFAULT_MAX_N}); "
                         "more are refused 400")
    ap.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="usage.prompt_tokens_details.cached_tokens in every answer: the prompt "
                         "tokens the engine's prefix cache served (vLLM's option; off: no "
                         "prompt_tokens_details, as vLLM without it)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="vLLM's switch for tool_choice auto, taken for vLLM's command lines: "
                         "here tool_choice auto is on wherever --tool-call-parser gives a format")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--log-stats-interval", type=_positive_seconds,
                    default=DEFAULT_LOG_STATS_INTERVAL_S,
                    help="seconds between the stats lines (throughput, running and waiting "
                         "requests, KV cache usage, prefix cache hit rate, as vLLM's engine logs "
                         f"them; default {DEFAULT_LOG_STATS_INTERVAL_S:g}); none while idle")
    ap.add_argument("--disable-log-stats", action="store_true",
                    help="no stats lines (vLLM's option)")
    ap.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                    help="the log's lines (the access log's and every other): text (default) or "
                         "json, one JSON object per line")
    # A worker's side of --workers (frontend/workers.py starts it so): not for users.
    ap.add_argument("--worker-socket-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-ready-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-of", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-created", type=int, help=argparse.SUPPRESS)
    return ap


def _listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only for sockets that
    # say so, and without it small SSE writes wait for the client's delayed ACK (about 40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # uvloop does not set it on accepted connections; Linux copies it from the listening socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """count listening sockets on one address, sharing it with SO_REUSEPORT (frontend/workers.py
    says why). A plain socket is bound first and closed: it fails as one process's would if the
    address is taken (sockets with SO_REUSEPORT would instead join another such group on it), and
    with port 0 it picks the port."""
    probe = _listening_socket(host, port)
    port = probe.getsockname()[1]
    probe.close()
    sockets = [_listening_socket(host, port, reuse_port=True) for _ in range(count)]
    for sock in sockets:
        sock.listen(2048)  # uvicorn's default backlog
    return sockets


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM handled as SIGINT: uvicorn drains on either and, once done, raises the signal it
    caught again; this turns that into KeyboardInterrupt (a clean exit), not death by SIGTERM."""
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace, sock: socket.socket, on_serving: Callable[[], None],
           created: Optional[int] = None) -> int:
    """Serves on sock until SIGTERM/SIGINT (0 once drained) or a failure to start (1)."""
    app = create_app(FrontendConfig(engine=args.engine, model_dir=args.model,
                                    served_model_name=args.served_model_name,
                                    request_timeout_s=args.request_timeout, created=created,
                                    engine_calls=args.engine_calls,
                                    max_request_body_bytes=args.max_request_body_bytes,
                                    max_model_len=args.max_model_len, api_key=args.api_key,
                                    cors=None if args.allowed_origins is None else CorsConfig(
                                        args.allowed_origins, args.allowed_methods,
                                        args.allowed_headers, args.allow_credentials),
                                    access_log=not args.disable_access_log,
                                    log_format=args.log_format,
                                    log_stats_interval_s=None if args.disable_log_stats
                                    else args.log_stats_interval,
                                    worker=args.worker_socket_fd is not None,
                                    tool_call_parser=args.tool_call_parser,
                                    reasoning_parser=args.reasoning_parser, max_n=args.max_n,
                                    enable_prompt_tokens_details=args.enable_prompt_tokens_details))
    # With JSON lines uvicorn's loggers keep no handlers of their own: their records reach the
    # root logger's (configure_logging).
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on",
                            log_config=None if args.log_format == "json" else LOGGING_CONFIG)
    server = uvicorn.Server(config)

    async def end_answers_before_the_drain_ends() -> None:
        while not server.should_exit:  # uvicorn's signal handler sets it
            await asyncio.sleep(0.1)
        await asyncio.sleep(GRACEFUL_SHUTDOWN_S - END_ANSWERS_BEFORE_S)
        app.state.frontend.engine.end_open_calls()

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_serving()
        ending = asyncio.ensure_future(end_answers_before_the_drain_ends())
        try:
            await task
        finally:
            ending.cancel()

    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _run(serve(), config)
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


def _worker_argv(args: argparse.Namespace, created: int) -> WorkerArgv:
    """A worker's command line (server.py run as a module) for this process's arguments."""
    def argv(sock_fd: int, ready_fd: int) -> list[str]:
        out = [sys.executable, "-m", "exl3serve_client.frontend.server",
               "--engine", args.engine, "--model", str(args.model),
               "--request-timeout", repr(args.request_timeout), "--log-level", args.log_level,
               "--log-format", args.log_format,
               "--log-stats-interval", repr(args.log_stats_interval),
               "--engine-calls", args.engine_calls, "--tool-call-parser", args.tool_call_parser,
               "--max-request-body-bytes", str(args.max_request_body_bytes),
               "--allowed-methods", json.dumps(args.allowed_methods),
               "--allowed-headers", json.dumps(args.allowed_headers),
               "--worker-socket-fd", str(sock_fd), "--worker-ready-fd", str(ready_fd),
               "--worker-of", str(os.getpid()),
               "--model-created", str(created)]
        if args.served_model_name is not None:
            out += ["--served-model-name", args.served_model_name]
        if args.allowed_origins is not None:
            out += ["--allowed-origins", json.dumps(args.allowed_origins)]
        if args.allow_credentials:
            out.append("--allow-credentials")
        if args.max_model_len is not None:
            out += ["--max-model-len", str(args.max_model_len)]
        if args.disable_access_log:
            out.append("--disable-access-log")
        if args.disable_log_stats:
            out.append("--disable-log-stats")
        if args.reasoning_parser is not None:
            out += ["--reasoning-parser", args.reasoning_parser]
        out += ["--max-n", str(args.max_n)]
        if args.enable_prompt_tokens_details:
            out.append("--enable-prompt-tokens-details")
        return out  # the API key reaches the workers in their environment (main)
    return argv


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if not (args.model / "tokenizer.json").exists():
        print(f"exl3serve-openai: {args.model}/tokenizer.json not found (a test model gets one from "
              "exl3serve-make-tokenizer --model DIR)", file=sys.stderr)
        return 2
    configure_logging(args.log_level, LogFormat(args.log_format))
    if args.worker_socket_fd is not None:  # one of a supervisor's workers
        exit_with_parent(args.worker_of)
        sock = socket.socket(fileno=args.worker_socket_fd)
        return _serve(args, sock, lambda: say_serving(args.worker_ready_fd), args.model_created)
    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key  # for --workers' processes, not on their argv
    host, port = args.listen
    host = args.host if args.host is not None else host
    port = args.port if args.port is not None else port
    shown = f"[{host}]" if ":" in host else host
    try:
        sockets = [_listening_socket(host, port)] if args.workers == 1 else \
            _worker_sockets(host, port, args.workers)
    except OSError as e:
        print(f"exl3serve-openai: cannot listen on {shown}:{port}: {e}", file=sys.stderr)
        return 1
    if args.workers == 1:
        url = f"http://{shown}:{sockets[0].getsockname()[1]}/v1"
        return _serve(args, sockets[0],
                      lambda: print(f"openai front end listening on {url}", flush=True))
    url = f"http://{shown}:{sockets[0].getsockname()[1]}/v1"
    supervisor = Supervisor(
        sockets, _worker_argv(args, int(time.time())),
        on_serving=lambda: print(f"openai front end listening on {url} ({args.workers} workers)",
                                 flush=True),
        # A worker's graceful shutdown, then its lifespan's end and the process's exit.
        drain_timeout_s=GRACEFUL_SHUTDOWN_S + 10)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
