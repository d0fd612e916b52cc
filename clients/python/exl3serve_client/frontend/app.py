"""The OpenAI-compatible HTTP front end over an exl3serve Generator (exl3-router): the ASGI app.

Text in, text out: prompts are tokenized (and chat messages rendered with the model's chat
template) here, token ids go to the engine over gRPC, and its tokens come back as text, streamed
as server-sent events the way OpenAI's API sends them. Nothing is kept beyond the open requests.

The generation endpoints are raw ASGI apps (GenerationEndpoint, _App says why), each request going
through the front end's parts in order: validation.py (the body into a PreparedRequest, or a
refusal), engine_call.py (the calls to the engine, one per choice), then render.py's
OpenAIRenderer for a whole answer or sse.py for a streamed one (answer_text.py splitting a chat
answer's reasoning and parsing its tool calls where the request has them). The other routes are
FastAPI's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .access import AccessLog, AccessLogWriter, ApiKeyGate, ASGIApp, header
from .engine_call import ENGINE_CALLS, Engine, EngineCall, RequestOutcome, shutting_down
from .log_format import LogFormat
from .metrics import FrontendMetrics, TokenClock
from .protocol import (CLIENT_CLOSED_REQUEST, APIError, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, Endpoint, FinishReason, TokenizeRequest)
from .answer_text import whole_answer_text
from .reasoning import ReasoningFormat
from .render import OpenAIRenderer
from .sse import SSEResponse, stream_events
from .stats_log import StatsLog
from .text import ModelTokenizer, StopMatcher
from .tokenizer_process import TokenizerProcess
from .tool_calls import tool_call_format
from .validation import (DEFAULT_MAX_N, PreparedRequest, RequestValidator, check_model, client_request_id,
                         parse_body, read_body)

__all__ = ["DEFAULT_MAX_N", "DEFAULT_MAX_REQUEST_BODY_BYTES", "ENGINE_CALLS", "CorsConfig", "Frontend",
           "FrontendConfig", "create_app"]

_log = logging.getLogger(__name__)

# --max-request-body-bytes' default: a million-token prompt as token ids in JSON is about 8 MB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class FrontendConfig:
    engine: str                       # HOST:PORT of the Generator service
    model_dir: Path                   # tokenizer.json, tokenizer_config.json, config.json
    served_model_name: Optional[str] = None  # default: the engine's model name
    request_timeout_s: float = 600.0
    health_cache_s: float = 1.0
    created: Optional[int] = None     # /v1/models' `created` (--workers: the parent's, in every worker)
    engine_calls: str = "stream"      # stream: one GenerateStream call for all requests; per-request: Generate each
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies: 413
    max_model_len: Optional[int] = None  # prompt + completion at most; None: the engine's context
    api_key: Optional[str] = None     # the API's routes need `Authorization: Bearer KEY`
    cors: Optional[CorsConfig] = None  # None: no CORS headers
    access_log: bool = True           # a line per request (access.py)
    log_format: str = "text"          # the log's lines: text or json (log_format.py)
    log_stats_interval_s: Optional[float] = None  # the stats line's period (stats_log.py); None: none
    worker: bool = False              # one of --workers' processes (the stats line names it)
    tool_call_parser: str = "auto"    # the model's tool-call format (tool_calls.py): auto from its template
    reasoning_parser: Optional[str] = None  # the reasoning split (reasoning.py); None: not split
    max_n: int = DEFAULT_MAX_N        # choices per request at most (more: 400)
    # usage.prompt_tokens_details.cached_tokens in every answer (vLLM's option of that name)
    enable_prompt_tokens_details: bool = False


@dataclass
class CorsConfig:
    """The CORS answers (Starlette's CORSMiddleware), as vLLM's --allowed-* options give them."""
    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class Frontend:
    """The front end's parts for one model: its tokenizer, the engine, the request validator and
    the metrics; answers a prepared request (answer) and serves /tokenize and /detokenize."""

    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        model_cfg_path = cfg.model_dir / "config.json"
        model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}
        # vLLM's token-count buckets go up to the context (the engine's, once it says, may only
        # be smaller: Engine.max_context).
        context = int(model_cfg.get("max_position_embeddings") or 0) or 4096
        self.metrics = FrontendMetrics(min(context, cfg.max_model_len or context))
        self.engine = Engine(cfg.engine, cfg.engine_calls, cfg.health_cache_s, self.metrics,
                             model_dir_name=cfg.model_dir.resolve().name,
                             config_max_context=int(model_cfg.get("max_position_embeddings") or 0),
                             served_model_name=cfg.served_model_name,
                             max_model_len=cfg.max_model_len)
        self.tok = ModelTokenizer(cfg.model_dir)
        self.tokenizer_process = TokenizerProcess(cfg.model_dir)
        self.validator = RequestValidator(self.tok, self.tokenizer_process, self.engine.model_name,
                                          self.engine.max_context, cfg.request_timeout_s,
                                          tool_call_format(cfg.tool_call_parser,
                                                           self.tok.chat_template),
                                          None if cfg.reasoning_parser is None
                                          else ReasoningFormat(cfg.reasoning_parser),
                                          cfg.max_n, cfg.enable_prompt_tokens_details)
        self.started = cfg.created if cfg.created is not None else int(time.time())

    # ---- generation ------------------------------------------------------------------------
    async def answer(self, req: PreparedRequest, receive: Any) -> Response:
        """Sends the request to the engine (a call per choice) and answers it: the whole answer,
        or a streamed one (its events written as the engine's messages arrive). Counts the
        request's outcome."""
        outcome = RequestOutcome(self.metrics, req)
        try:
            calls = await EngineCall.start_all(self.engine, req, receive,
                                               self.cfg.request_timeout_s)
        except BaseException as e:
            outcome.failed(e.status if isinstance(e, APIError) else 500)
            outcome.close()
            raise
        outs = [OpenAIRenderer(req, self.tok, i) for i in range(len(calls))]  # choice i
        if req.stream:
            return SSEResponse(stream_events(req, calls, outs, self.tok, self.metrics, outcome),
                               headers={"Cache-Control": "no-cache", "X-Request-Id": req.header_rid})
        return await self._whole(req, calls, outs, outcome)

    async def _whole_choice(self, req: PreparedRequest, call: EngineCall, out: OpenAIRenderer,
                            clock: TokenClock) -> tuple[str, int, int, Optional[str]]:
        """One choice of a whole answer: its rendering, its tokens, the prompt tokens the prefix
        cache served, and the prompt's logprobs (vLLM's prompt_logprobs, rendered) where asked."""
        text, entries, n, finish, cached = [], [], 0, None, 0
        prompt_lp: Any = ()
        async for p in call.pieces(self.tok.detokenizer(), StopMatcher(req.stops), self.metrics):
            clock.handed(len(p.tokens))
            if p.prompt_logprobs:
                prompt_lp = p.prompt_logprobs
            cached = max(cached, p.cached_tokens)
            finish = p.finish
            if req.echo is not None and req.echo.only:
                continue  # max_tokens 0: the engine's one token is not the answer's
            text.append(p.text)
            n += len(p.tokens)
            if req.logprobs is not None:
                entries.extend(out.logprob_entries(p.tokens))
        prompt = req.prompts[req.prompt_of(out.index)]
        if req.echo is not None:  # the prompt first, its first token without a logprob
            text.insert(0, req.echo.texts[req.prompt_of(out.index)])
            if req.logprobs is not None:
                entries[:0] = out.echo_entries(prompt, prompt_lp)
            if req.echo.only:
                finish = FinishReason.LENGTH
        rendered_prompt_lp = None if req.prompt_logprobs is None else out.prompt_logprobs(prompt_lp)
        content, reasoning, tool_calls = "".join(text), None, None
        if req.tool_use is not None or req.reasoning is not None:
            content, reasoning, tool_calls = whole_answer_text(req, content)
            if finish is FinishReason.STOP and tool_calls:
                finish = FinishReason.TOOL_CALLS
        lp = None if req.logprobs is None else out.logprobs(entries, 0)
        return (out.choice(content, lp, finish, tool_calls, reasoning, rendered_prompt_lp), n,
                cached, rendered_prompt_lp)

    async def _whole(self, req: PreparedRequest, calls: list[EngineCall],
                     outs: list[OpenAIRenderer], outcome: RequestOutcome) -> Response:
        outcome.failed(500)  # until answered: a cancelled or broken answer is the server's
        clock = TokenClock(self.metrics, req.endpoint.value, req.started)
        tasks: list[asyncio.Future] = []
        try:
            if len(calls) == 1:
                choices = [await self._whole_choice(req, calls[0], outs[0], clock)]
            else:  # the first choice to fail fails the request; finally cancels the others
                tasks = [asyncio.ensure_future(self._whole_choice(req, c, o, clock))
                         for c, o in zip(calls, outs)]
                choices = await asyncio.gather(*tasks)
            # The cache's tokens once per prompt: its first choice's.
            cached = sum(c[2] for i, c in enumerate(choices) if i % req.n == 0)
            body = outs[0].answer([c[0] for c in choices], sum(c[1] for c in choices), cached,
                                  choices[0][3] if req.chat else None)
            outcome.complete()
            return Response(body, media_type="application/json",
                            headers={"X-Request-Id": req.header_rid})
        except asyncio.CancelledError:
            if calls[0].client_gone:
                # The client went away and the watcher cancelled the calls: nobody to answer.
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if any(c.shut_down for c in calls):  # the server's shutdown ended the calls
                err = shutting_down()
                outcome.failed(err.status)
                raise err from None
            raise
        except grpc.aio.AioRpcError as e:
            err = self.engine.rpc_error(e)
            outcome.failed(err.status)
            raise err from None
        except APIError as e:
            outcome.failed(e.status)
            raise
        finally:
            for t in tasks:
                t.cancel()
            if calls[0].client_gone:
                outcome.client_gone()
            for call in calls:
                call.close()
            outcome.close()

    # ---- /tokenize and /detokenize ---------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        text, add_special = self.validator.tokenize_text(body)
        ids = await self.validator.any_length_ids(text, add_special)
        strs = [self.tok.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_context(), "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, self.engine.model_name())
        vocab = self.tok.vocab_size
        bad = next(((i, t) for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad[0]}] is {bad[1]}, outside the vocabulary "
                           f"(0 to {vocab - 1})", param="tokens")
        return {"prompt": self.tok.decode(body.tokens, skip_special_tokens=False)}


@dataclass
class GenerationEndpoint:
    """POST /v1/completions or /v1/chat/completions as an ASGI app of its own: the body read (up to
    --max-request-body-bytes) and validated (validation.py), the request answered (JSON or
    server-sent events), every refusal an OpenAI error body counted by its status."""
    fe: Frontend
    endpoint: Endpoint
    body_type: type[BaseModel]
    prepare: Callable[[Any, Optional[str]], Awaitable[PreparedRequest]]  # RequestValidator's

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        given = header(scope, b"x-request-id")
        echo = {"X-Request-Id": given.decode("latin-1")} if given else None
        requests = self.fe.metrics.requests
        try:
            raw = await read_body(receive, self.fe.cfg.max_request_body_bytes)
            client_rid = client_request_id(None if given is None else given.decode("latin-1"),
                                           "X-Request-Id")
            body = parse_body(raw, self.body_type)
            await self.fe.engine.need()
            req = await self.prepare(body, client_rid)
        except ClientDisconnect:
            requests.labels(self.endpoint.value, str(CLIENT_CLOSED_REQUEST)).inc()
            return
        except APIError as e:
            requests.labels(self.endpoint.value, str(e.status)).inc()
            await JSONResponse(e.body(), status_code=e.status, headers=echo)(scope, receive, send)
            return
        except Exception:  # a bug: logged, and answered in OpenAI's error body all the same
            _log.exception("preparing a %s request failed", self.endpoint.value)
            requests.labels(self.endpoint.value, "500").inc()
            err = APIError(500, "the front end failed to prepare the request (its log says why)")
            await JSONResponse(err.body(), status_code=500, headers=echo)(scope, receive, send)
            return
        try:
            response = await self.fe.answer(req, receive)  # counts its own outcome
        except APIError as e:
            response = JSONResponse(e.body(), status_code=e.status, headers=echo)
        await response(scope, receive, send)


class _App(FastAPI):
    """FastAPI, but for the generation endpoints, which it hands their ASGI calls directly: its
    middlewares, routing and dependency solving cost a request about as much CPU as all of the
    front end's own work on it (bench/results/frontend.md), and a burst of requests waits for that
    one after another."""

    def __init__(self, *, generation: dict[str, GenerationEndpoint], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generation = generation
        # What an HTTP request goes through first (set_entry): the access log, CORS, the API key.
        self.entry: ASGIApp = self.route

    def set_entry(self, cfg: FrontendConfig) -> None:
        entry: ASGIApp = self.route
        if cfg.api_key:
            entry = ApiKeyGate(entry, cfg.api_key)
        if cfg.cors is not None:  # outside the key: a browser's preflight carries none
            entry = CORSMiddleware(entry, allow_origins=cfg.cors.allowed_origins,
                                   allow_methods=cfg.cors.allowed_methods,
                                   allow_headers=cfg.cors.allowed_headers,
                                   allow_credentials=cfg.cors.allow_credentials,
                                   expose_headers=["X-Request-Id"])
        if cfg.access_log:
            entry = AccessLog(entry, AccessLogWriter(fmt=LogFormat(cfg.log_format)))
        self.entry = entry

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self.entry(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def route(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            endpoint = self.generation.get(scope["path"])
            if endpoint is not None:
                if scope["method"] == "POST":
                    await endpoint(scope, receive, send)
                else:
                    err = APIError(405, f"{scope['method']} is not allowed on {scope['path']}: "
                                   "POST it")
                    await JSONResponse(err.body(), status_code=405,
                                       headers={"Allow": "POST"})(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(cfg: FrontendConfig) -> FastAPI:
    fe = Frontend(cfg)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await fe.engine.open()
        await fe.engine.check(force=True)
        if cfg.max_model_len and fe.engine.info is not None and \
                cfg.max_model_len > fe.engine.engine_context():
            message = (f"--max-model-len {cfg.max_model_len} is more than the engine's context "
                       f"({fe.engine.engine_context()} tokens)")
            print(f"exl3serve-openai: {message}", file=sys.stderr, flush=True)
            raise SystemExit(message)
        await fe.tokenizer_process.start()
        stats_log = None if cfg.log_stats_interval_s is None else asyncio.ensure_future(StatsLog(
            fe.metrics.vllm.tally, fe.engine.engine_stats,
            AccessLogWriter(fmt=LogFormat(cfg.log_format)), cfg.log_stats_interval_s,
            cfg.worker).run())
        yield
        if stats_log is not None:
            stats_log.cancel()
        fe.tokenizer_process.close()
        await fe.engine.close()

    app = _App(title="exl3serve OpenAI-compatible front end", lifespan=lifespan, generation={
        "/v1/completions": GenerationEndpoint(fe, Endpoint.COMPLETIONS, CompletionRequest,
                                              fe.validator.completion),
        "/v1/chat/completions": GenerationEndpoint(fe, Endpoint.CHAT_COMPLETIONS,
                                                   ChatCompletionRequest, fe.validator.chat),
    })
    app.state.frontend = fe
    app.set_entry(cfg)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Starlette's own answers (404 no such route, 405 method not allowed) in OpenAI's body."""
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
                       e.status_code, str(e.detail))
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        """A client that went away while its body was read: the access log's 499, no traceback."""
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _parsed(request: Request, body_type: type[BaseModel]) -> Any:
        return parse_body(await read_body(request.receive, cfg.max_request_body_bytes), body_type)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await fe.tokenize(await _parsed(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return fe.detokenize(await _parsed(request, DetokenizeRequest))

    def _model_card() -> dict[str, Any]:
        return {"id": fe.engine.model_name(), "object": "model", "created": fe.started,
                "owned_by": "exl3serve", "root": str(cfg.model_dir), "max_model_len": fe.engine.max_context()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        await fe.engine.check()
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        await fe.engine.check()
        check_model(model_id, fe.engine.model_name())
        return _model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        up = await fe.engine.check()
        return JSONResponse({"status": "ok" if up else "engine unavailable",
                             "engine": cfg.engine}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await fe.engine.refresh_stats()  # the engine's state under vLLM's names
        return Response(generate_latest(fe.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
