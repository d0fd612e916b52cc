"""The OpenAI-compatible HTTP front end over an exl3serve Generator (exl3-router): FastAPI app.

Text in, text out: prompts are tokenized (and chat messages rendered with the model's chat
template) here, token ids go to the engine over gRPC, and its tokens come back as text, streamed
as server-sent events the way OpenAI's API sends them. Nothing is kept beyond the open requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import (Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping,
                    Optional, Union)

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exl3serve.v1 import exl3serve_pb2 as pb

from ..generate import FINISH_REASONS, AsyncGenerateClient, make_generate_request
from ..generate_stream import GenerateCall, GenerateStreamClient
from .access import AccessLog, ApiKeyGate, ASGIApp, header
from .metrics import FrontendMetrics
from .protocol import (INT32_MAX, UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_FIELDS, APIError,
                       ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, _Sampling, unsupported_field)
from .text import ChatTemplateError, ModelTokenizer, StopMatcher
from .tokenizer_process import TokenizerProcess, TokenizerProcessDied

_log = logging.getLogger(__name__)

# gRPC status -> HTTP status of the answer.
_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


# The request fields the engine's refusals name first (engine/engine.cc, Engine::Validate:
# "min_tokens must be in [0, max_tokens], not 9", "stop_token_ids token 0 is 999, outside ...").
_ENGINE_FIELDS = ("max_tokens", "min_tokens", "stop_token_ids", "temperature", "top_p", "top_k",
                  "min_p", "repetition_penalty", "presence_penalty", "logprobs")


def _engine_param(details: str) -> Optional[str]:
    """The OpenAI error's `param` for an engine refusal: the field its message starts with."""
    for name in _ENGINE_FIELDS:
        if details.startswith(name + " "):
            return name
    if details.startswith(("the prompt ", "prompt token ", "prompt (")):
        return "prompt"
    return None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# A str as _dumps writes it (json's C encoder of ensure_ascii=False), without json.dumps' dispatch.
_jstr = json.encoder.encode_basestring


class ChunkRenderer:
    """The SSE events of one streamed answer, as _dumps of Frontend._envelope / _choice renders
    them, byte for byte, but from strings made once per request: the per-token event is then a
    few concatenations and one string escape (tests/clients/python/test_text.py compares the two)."""

    def __init__(self, job: "Job") -> None:
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        self.chat = job.chat
        self.head = (f'data: {{"id":{_jstr(job.rid)},"object":"{obj}","created":{int(job.created)},'
                     f'"model":{_jstr(job.model)},"choices":[')
        self.tail = (',"usage":null}\n\n' if job.include_usage else '}\n\n')
        self.open = self.head + ('{"index":0,"delta":' if job.chat else '{"index":0,"text":')

    def role(self) -> str:
        """Chat's first event: the assistant's role and empty content."""
        return self.open + '{"role":"assistant","content":""},"logprobs":null,' \
            '"finish_reason":null}]' + self.tail

    def text(self, text: str, logprobs: Optional[str] = None) -> str:
        """An event with text (and logprobs, already rendered; None: null)."""
        lp = "null" if logprobs is None else logprobs
        if self.chat:
            delta = '{"content":' + _jstr(text) + "}" if text else "{}"
            return self.open + delta + ',"logprobs":' + lp + ',"finish_reason":null}]' + self.tail
        return self.open + _jstr(text) + ',"logprobs":' + lp + ',"finish_reason":null}]' + self.tail

    def finish(self, reason: str) -> str:
        if self.chat:
            return self.open + '{},"logprobs":null,"finish_reason":' + _jstr(reason) + "}]" + self.tail
        return self.open + '"","logprobs":null,"finish_reason":' + _jstr(reason) + "}]" + self.tail

    def usage(self, usage: dict[str, Any]) -> str:
        return self.head + '],"usage":' + _dumps(usage) + "}\n\n"


_DONE_EVENT = "data: [DONE]\n\n"  # a stream's last event (SSEResponse ends the response with it)
_DONE = _DONE_EVENT.encode()


class SSEResponse(Response):
    """A streamed answer: its events (bytes) written as they come. Starlette's StreamingResponse
    does the same but runs a task group listening for the client's disconnect; here the disconnect
    is Frontend.start's watcher's (it cancels the engine call, which ends the events)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        ended = False
        try:
            async for event in self.events:
                # [DONE] is the stream's last event: the response ends with its write.
                ended = event.endswith(_DONE)
                await send({"type": "http.response.body", "body": event, "more_body": not ended})
        except OSError:
            raise ClientDisconnect() from None
        finally:
            await self.events.aclose()
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# --max-request-body-bytes' default: a million-token prompt as token ids in JSON is about 8 MB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024

# A prompt text at least this long is tokenized in the tokenizer process (Frontend._prompt_ids); a
# shorter one on the event loop, where it costs less than the handover (8192 characters: 2-3.5 ms
# with the test models' tokenizer, about 0.5 ms to and from the process).
TOKENIZE_OFF_LOOP_CHARS = 8192


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


@dataclass
class CorsConfig:
    """The CORS answers (Starlette's CORSMiddleware), as vLLM's --allowed-* options give them."""
    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


# A client's request id (X-Request-Id, or vLLM's request_id field): visible ASCII, this long at most.
MAX_REQUEST_ID_CHARS = 128


def client_request_id(value: Optional[str], what: str) -> Optional[str]:
    """The client's request id, checked: it goes into the answer's id, a header and the engine's
    logs."""
    if value is None or value == "":
        return None
    if len(value) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in value):
        raise APIError(400, f"{what} must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                       "characters", param="request_id" if what == "request_id" else None)
    return value


ENGINE_CALLS = ("stream", "per-request")


class Engine:
    """The engine's channel and what DescribeModel said; refreshed while the engine is away.
    `calls` starts the requests: cfg.engine_calls "stream" puts them all on one GenerateStream call
    (generate_stream.py, on the same channel), "per-request" makes one Generate call each."""

    def __init__(self, cfg: FrontendConfig, metrics: FrontendMetrics) -> None:
        if cfg.engine_calls not in ENGINE_CALLS:
            raise ValueError(f"engine_calls must be one of {ENGINE_CALLS}, not {cfg.engine_calls!r}")
        self.cfg = cfg
        self.metrics = metrics
        self.client: Optional[AsyncGenerateClient] = None
        self.calls: Optional[Union[AsyncGenerateClient, GenerateStreamClient]] = None
        self.info: Optional[pb.DescribeModelResponse] = None
        self.up = False
        self._checked = 0.0

    async def open(self) -> None:
        self.client = AsyncGenerateClient(self.cfg.engine)
        self.calls = GenerateStreamClient(self.client.channel) \
            if self.cfg.engine_calls == "stream" else self.client

    async def close(self) -> None:
        if isinstance(self.calls, GenerateStreamClient):
            await self.calls.close()
        if self.client is not None:
            await self.client.close()

    def mark(self, up: bool) -> None:
        self.up = up
        self.metrics.engine_up.set(1 if up else 0)

    async def check(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._checked < self.cfg.health_cache_s:
            return self.up
        self._checked = now
        client = self.client
        try:
            if client is None:
                raise ConnectionError("the engine client is not open")
            self.info = await client.describe(timeout=2.0)
            self.mark(self.info.state != pb.STATE_DRAINING)
        except Exception:  # any failure to answer is "away"
            self.mark(False)
        return self.up


@dataclass
class Job:
    """One request, prepared: the engine request and what the answer needs."""
    endpoint: str                    # completions | chat_completions
    chat: bool
    model: str
    prompt_ids: list[int]
    request: pb.GenerateRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]          # top-N asked (0: the chosen token's only); None: none
    ids_as_tokens: bool = False      # logprobs name tokens "token_id:ID" (vLLM's extension)
    header_rid: str = ""             # the answer's X-Request-Id: the client's id, else rid
    started: float = field(default_factory=time.monotonic)
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class TokenClock:
    """One request's token timing as its client sees it: TTFT at the first token handed to the
    client, then inter-token gaps (n tokens handed over at once: n gaps of 1/n of the time since
    the previous ones; the first n: TTFT and n - 1 gaps of 0)."""

    def __init__(self, metrics: FrontendMetrics, job: Job) -> None:
        self.ttft = metrics.ttft_of[job.endpoint]
        self.itl = metrics.itl_of[job.endpoint]
        self.started = job.started
        self.last: Optional[float] = None

    def handed(self, n: int) -> None:
        """n tokens' text has just been handed to the client."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.ttft.observe(now - self.started)
            for _ in range(n - 1):
                self.itl.observe(0.0)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.itl.observe(gap)
        self.last = now


@dataclass
class Piece:
    """What one engine message adds to the answer."""
    text: str
    tokens: list[Any]
    finish: Optional[str]


class Frontend:
    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        self.metrics = FrontendMetrics()
        self.engine = Engine(cfg, self.metrics)
        self.tok = ModelTokenizer(cfg.model_dir)
        self.tokenizer_process = TokenizerProcess(cfg.model_dir)
        model_cfg_path = cfg.model_dir / "config.json"
        model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}
        self.config_max_context = int(model_cfg.get("max_position_embeddings") or 0)
        self.started = cfg.created if cfg.created is not None else int(time.time())
        self.dir_name = cfg.model_dir.resolve().name  # the name while the engine has said none

    # ---- what the engine says --------------------------------------------------------------
    def model_name(self) -> str:
        if self.cfg.served_model_name:
            return self.cfg.served_model_name
        if self.engine.info is not None and self.engine.info.model:
            return self.engine.info.model
        return self.dir_name

    def engine_context(self) -> int:
        if self.engine.info is not None and self.engine.info.max_context:
            return int(self.engine.info.max_context)
        return self.config_max_context or 4096

    def max_context(self) -> int:
        """Tokens of prompt and completion together at most: --max-model-len, within the engine's."""
        ctx = self.engine_context()
        return min(ctx, self.cfg.max_model_len) if self.cfg.max_model_len else ctx

    async def need_engine(self) -> None:
        if not self.engine.up and not await self.engine.check(force=True):
            raise APIError(503, "the engine is unavailable", code="engine_unavailable")

    # ---- preparing a request ---------------------------------------------------------------
    def _common(self, body: _Sampling, endpoint: str) -> None:
        if body.model != self.model_name():
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model",
                           code="model_not_found")
        refused = unsupported_field(body.model_extra, UNSUPPORTED_FIELDS)
        if refused is None and endpoint == "chat_completions":
            refused = unsupported_field(body.model_extra, UNSUPPORTED_CHAT_FIELDS)
        if refused is not None:
            name, why = refused
            raise APIError(400, f"{name}: {why}", param=name)
        if body.n not in (None, 1):
            raise APIError(400, "n must be 1: one choice per request is supported", param="n")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise APIError(400, f"response_format of type {body.response_format.get('type')!r}: "
                           "constrained decoding (structured output) is not supported yet",
                           param="response_format")
        if body.stream_options is not None and body.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported: the "
                           "usage comes in the stream's last chunk (include_usage)",
                           param="stream_options.continuous_usage_stats")

    def _stops(self, body: _Sampling) -> list[str]:
        stop = body.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16:
            raise APIError(400, "at most 16 stop strings", param="stop")
        return [s for s in stops if s]

    def _job(self, body: _Sampling, endpoint: str, chat: bool, prompt_ids: list[int],
             max_tokens: Optional[int], logprobs: Optional[int], client_rid: Optional[str],
             max_tokens_param: str = "max_tokens") -> Job:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        ctx = self.max_context()
        if len(prompt_ids) >= ctx:
            raise _prompt_too_long(ctx, len(prompt_ids), "messages" if chat else "prompt")
        if max_tokens is None:
            max_tokens = ctx - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, "
                           f"you requested {len(prompt_ids) + max_tokens} tokens "
                           f"({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
                           "Please reduce the length of the prompt or the completion.",
                           param=max_tokens_param, code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        seed = None if body.seed is None else body.seed & 0xFFFFFFFFFFFFFFFF
        client_rid = client_rid or client_request_id(body.request_id, "request_id")
        rid = ("chatcmpl-" if chat else "cmpl-") + (client_rid or uuid.uuid4().hex)
        req = make_generate_request(
            prompt_ids, max_tokens=max_tokens, temperature=temperature,
            top_p=body.top_p or 0.0, top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, seed=seed,
            logprobs=logprobs or 0, min_tokens=body.min_tokens or 0,
            stop_token_ids=body.stop_token_ids or (), ignore_eos=bool(body.ignore_eos),
            timeout_us=int(self.cfg.request_timeout_s * 1e6), request_id=rid)
        return Job(endpoint=endpoint, chat=chat, model=self.model_name(), prompt_ids=prompt_ids,
                   request=req, stops=self._stops(body), stream=bool(body.stream),
                   include_usage=bool(body.stream and body.stream_options and
                                      body.stream_options.include_usage),
                   logprobs=logprobs, rid=rid, header_rid=client_rid or rid,
                   ids_as_tokens=bool(body.return_tokens_as_token_ids))

    async def _prompt_ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The prompt text's token ids. A long text is first held against the context by the
        tokenizer's lower bound of its tokens (refused untokenized where that already exceeds it),
        then tokenized in the tokenizer process (tokenizer_process.py), so that the event loop
        serves the other requests meanwhile; one of the context's length or more is refused
        without its ids made. A short one is tokenized here (_job checks its length)."""
        if len(text) < TOKENIZE_OFF_LOOP_CHARS:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        ctx = self.max_context()
        at_least = self.tok.min_token_count(text)
        if at_least >= ctx:
            raise _prompt_too_long(ctx, at_least, param, at_least=True)
        try:
            n, ids = await self.tokenizer_process.encode(text, ctx, add_special_tokens)
        except TokenizerProcessDied as e:
            raise APIError(500, str(e)) from None
        if ids is None:
            raise _prompt_too_long(ctx, n, param)
        return ids

    async def completion_job(self, body: CompletionRequest, client_rid: Optional[str]) -> Job:
        self._common(body, "completions")
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        p = body.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            ids = await self._prompt_ids(p, True, "prompt")
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            ids = [t for t in p if isinstance(t, int)]  # all of them
            if ids and (min(ids) < -INT32_MAX - 1 or max(ids) > INT32_MAX):
                i, bad = next((i, t) for i, t in enumerate(ids)
                              if not -INT32_MAX - 1 <= t <= INT32_MAX)
                raise APIError(400, f"prompt token {i} is {bad}, beyond a token id's range (int32)",
                               param="prompt")
        else:
            raise APIError(400, "one prompt per request: a string or a list of token ids",
                           param="prompt")
        return self._job(body, "completions", False, ids, body.max_tokens, body.logprobs,
                         client_rid)

    async def chat_job(self, body: ChatCompletionRequest, client_rid: Optional[str]) -> Job:
        self._common(body, "chat_completions")
        if body.tools:
            raise APIError(400, "tools are not supported yet", param="tools")
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice other than none or auto: tools are not supported yet",
                           param="tool_choice")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        text = self.chat_prompt(body.messages, body.add_generation_prompt,
                                body.chat_template_kwargs)
        # As encode_chat: the rendering holds its special tokens.
        ids = await self._prompt_ids(text, False, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._job(body, "chat_completions", True, ids, max_tokens, logprobs, client_rid,
                         "max_completion_tokens" if body.max_completion_tokens else "max_tokens")

    def chat_prompt(self, chat: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: Optional[dict[str, Any]]) -> str:
        """The messages rendered with the model's chat template."""
        messages = []
        for m in chat:
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # content parts: their text, in order
                parts = []
                for part in m.content:
                    if part.get("type") != "text":
                        raise APIError(400, f"content part of type {part.get('type')!r} is not "
                                       "supported", param="messages")
                    parts.append(part.get("text", ""))
                msg["content"] = "".join(parts)
            msg.setdefault("content", "")
            messages.append(msg)
        try:
            return self.tok.render_chat(messages, add_generation_prompt, **(template_kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None

    # ---- /tokenize and /detokenize ---------------------------------------------------------
    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name():
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.tools:
            raise APIError(400, "tools are not supported yet", param="tools")
        refused = unsupported_field(body.model_extra, UNSUPPORTED_CHAT_FIELDS)
        if refused is not None:
            raise APIError(400, f"{refused[0]}: {refused[1]}", param=refused[0])
        if body.messages is not None:
            text = self.chat_prompt(body.messages, body.add_generation_prompt,
                                    body.chat_template_kwargs)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        if len(text) < TOKENIZE_OFF_LOOP_CHARS:
            ids = self.tok.encode(text, add_special_tokens=add_special)
        else:  # no limit: the body's is the bound
            try:
                _, got = await self.tokenizer_process.encode(text, INT32_MAX, add_special)
            except TokenizerProcessDied as e:
                raise APIError(500, str(e)) from None
            ids = got or []
        strs = [self.tok.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_context(), "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        vocab = self.tok.vocab_size
        bad = next(((i, t) for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad[0]}] is {bad[1]}, outside the vocabulary "
                           f"(0 to {vocab - 1})", param="tokens")
        return {"prompt": self.tok.decode(body.tokens, skip_special_tokens=False)}

    # ---- running it ------------------------------------------------------------------------
    async def pieces(self, job: Job, call: GenerateCall,
                     first: Any) -> AsyncIterator[Piece]:
        """The answer's text as the engine's messages arrive; stops at a stop string (cancelling the
        engine request) or at the engine's finish."""
        detok = self.tok.detokenizer()
        stop = StopMatcher(job.stops)
        resp = first
        while resp is not grpc.aio.EOF:
            ended = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            text = detok.add(t.token_id for t in resp.tokens)
            if ended:
                text += detok.finish()
            text = stop.push(text, final=ended)
            self.metrics.generation_tokens.inc(len(resp.tokens))
            if stop.stopped:
                call.cancel()
                yield Piece(text, list(resp.tokens), "stop")
                return
            finish = FINISH_REASONS.get(resp.finish_reason) if ended else None
            if finish in ("abort", "error"):
                # The call's status says why (deadline, lost experts): read() raises it.
                await call.read()
                raise APIError(500, f"the engine ended the request ({finish})")
            yield Piece(text, list(resp.tokens), finish)
            if ended:
                return
            resp = await call.read()
        raise APIError(500, "the engine's stream ended without a finish reason")

    def _token_text(self, job: Job, token_id: int) -> tuple[str, bytes]:
        if job.ids_as_tokens:
            s = f"token_id:{token_id}"
            return s, s.encode()
        return self.tok.token_text(token_id)

    def _logprobs_entries(self, job: Job, tokens: list[Any]) -> list[dict[str, Any]]:
        entries = []
        for t in tokens:
            text, b = self._token_text(job, t.token_id)
            tops = []
            for e in t.top_logprobs[:job.logprobs or 0]:
                et, eb = self._token_text(job, e.token_id)
                tops.append({"token": et, "logprob": e.logprob, "bytes": list(eb)})
            entries.append({"token": text, "logprob": t.logprob, "bytes": list(b),
                            "top_logprobs": tops})
        return entries

    @staticmethod
    def _completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
            out["text_offset"].append(offset)
            offset += len(e["token"])
        return out

    @staticmethod
    def _usage(job: Job, completion_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion_tokens,
                "total_tokens": len(job.prompt_ids) + completion_tokens}

    def _choice(self, job: Job, text: str, entries: Optional[list[dict[str, Any]]],
                finish: Optional[str], offset: int, *, delta: bool, first: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if job.chat:
            if delta:
                d: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                    ({"content": text} if text else {})
                choice["delta"] = d
            else:
                choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None if entries is None else {"content": entries, "refusal": None}
        else:
            choice["text"] = text
            choice["logprobs"] = None if entries is None else self._completion_logprobs(entries, offset)
        choice["finish_reason"] = finish
        return choice

    def _envelope(self, job: Job, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        return {"id": job.rid, "object": obj, "created": job.created, "model": job.model,
                "choices": choices}

    async def start(self, job: Job, request: Request) -> tuple[GenerateCall, Any, asyncio.Task]:
        """Sends the request to the engine and waits for its first message, so that a refusal
        becomes the HTTP status. A task watching the client cancels the call if it goes away."""
        if self.engine.calls is None:
            raise APIError(503, "the engine is not connected")
        call = self.engine.calls.call(job.request, timeout=self.cfg.request_timeout_s)
        watcher = asyncio.ensure_future(_watch_disconnect(request, call))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            watcher.cancel()
            raise self._rpc_error(e) from None
        except BaseException:
            watcher.cancel()
            call.cancel()
            raise
        self.engine.mark(True)
        return call, first, watcher

    def _rpc_error(self, e: grpc.aio.AioRpcError) -> APIError:
        status = _HTTP_OF.get(e.code(), 500)
        if status == 503:
            self.engine.mark(False)
            return APIError(503, f"the engine is unavailable: {e.details()}", code="engine_unavailable")
        if status == 504:
            return APIError(504, f"the request timed out: {e.details()}", code="timeout")
        if status == 429:
            return APIError(429, f"the engine is overloaded: {e.details()}", code="overloaded")
        details = e.details() or e.code().name
        if e.code() == grpc.StatusCode.UNIMPLEMENTED and self.cfg.engine_calls == "stream":
            details = ("the engine does not serve Generator.GenerateStream (an older exl3-router?): "
                       f"run the front end with --engine-calls per-request ({details})")
        return APIError(status, details, param=_engine_param(details) if status == 400 else None)

    async def answer(self, job: Job, request: Request) -> Response:
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        try:
            call, first, watcher = await self.start(job, request)
        except BaseException as e:
            self.metrics.running.dec()
            self._done(job, e.status if isinstance(e, APIError) else 500)
            raise
        if job.stream:
            return SSEResponse(self._sse(job, call, first, watcher),
                               headers={"Cache-Control": "no-cache", "X-Request-Id": job.header_rid})
        status = 500
        try:
            text, entries, n, finish = [], [], 0, None
            clock = TokenClock(self.metrics, job)
            async for p in self.pieces(job, call, first):
                clock.handed(len(p.tokens))
                text.append(p.text)
                n += len(p.tokens)
                if job.logprobs is not None:
                    entries.extend(self._logprobs_entries(job, p.tokens))
                finish = p.finish
            body = self._envelope(job, [self._choice(job, "".join(text), entries if job.logprobs
                                                     is not None else None, finish, 0,
                                                     delta=False)], chunk=False)
            body["usage"] = self._usage(job, n)
            status = 200
            return JSONResponse(body, headers={"X-Request-Id": job.header_rid})
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():
                # The client went away and the watcher cancelled the call: nobody to answer.
                return Response(status_code=499)
            raise
        except grpc.aio.AioRpcError as e:
            err = self._rpc_error(e)
            status = err.status
            raise err from None
        except APIError as e:
            status = e.status
            raise
        finally:
            watcher.cancel()
            call.cancel()
            self.metrics.running.dec()
            self._done(job, 499 if watcher.done() and not watcher.cancelled() else status)

    async def _sse(self, job: Job, call: GenerateCall, first: Any,
                   watcher: asyncio.Task) -> AsyncGenerator[bytes, None]:
        """The streamed answer: one SSE event per engine message that adds text (a message carries
        every token the engine had ready for the request), as pieces() would give them, with the
        events pre-rendered (ChunkRenderer), one write per engine message, and the per-token work
        inline: this loop is the front end's hot path. The last write ends with [DONE]."""
        status = 499  # until the answer is complete, a closing client is why it stops
        out = ChunkRenderer(job)
        m = self.metrics
        gen_tokens = m.generation_tokens
        detok = self.tok.detokenizer()
        add_bytes = getattr(detok, "add_bytes", None)  # byte-level BPE: the tokens' bytes
        token_bytes = self.tok.token_bytes
        stop = StopMatcher(job.stops) if job.stops else None
        want_lp = job.logprobs is not None
        unspecified = pb.FINISH_REASON_UNSPECIFIED
        # What an engine message adds is one write: its events joined (chat's role event, as
        # OpenAI sends it first, with the first text event; the last text event with the finish,
        # the usage and [DONE]), written before the stream waits for the engine's next message.
        pending = out.role() if job.chat else ""
        clock = TokenClock(m, job)
        try:
            n, offset = 0, 0
            resp = first
            try:
                while True:
                    if resp is grpc.aio.EOF:
                        raise APIError(500, "the engine's stream ended without a finish reason")
                    tokens = resp.tokens
                    k = len(tokens)
                    ended = resp.finish_reason != unspecified
                    if add_bytes is not None:
                        if k == 1:
                            text = add_bytes(token_bytes(tokens[0].token_id))
                        else:
                            text = add_bytes(b"".join([token_bytes(t.token_id) for t in tokens]))
                    else:
                        text = detok.add([t.token_id for t in tokens])
                    if ended:
                        text += detok.finish()
                    if stop is not None:
                        text = stop.push(text, final=ended)
                    gen_tokens.inc(k)
                    finish: Optional[str] = None
                    if stop is not None and stop.stopped:
                        call.cancel()
                        finish = "stop"
                    elif ended:
                        finish = FINISH_REASONS.get(resp.finish_reason)
                        if finish in ("abort", "error"):
                            # The call's status says why (deadline, lost experts): read() raises it.
                            await call.read()
                            raise APIError(500, f"the engine ended the request ({finish})")
                    n += k
                    entries = self._logprobs_entries(job, list(tokens)) if want_lp else None
                    shown = 0  # tokens whose text this write hands to the client
                    if text or entries:
                        lp = None if entries is None else _dumps(
                            {"content": entries, "refusal": None} if job.chat else
                            self._completion_logprobs(entries, offset))
                        offset += len(text)
                        pending += out.text(text, lp)
                        shown = k
                    if finish is not None:
                        pending += out.finish(finish)
                        break
                    if pending:
                        yield pending.encode()
                        pending = ""
                    clock.handed(shown)
                    resp = await call.read()
            except asyncio.CancelledError:
                if watcher.done() and not watcher.cancelled():
                    return  # the client went away and the watcher cancelled the call
                raise
            except grpc.aio.AioRpcError as e:
                if watcher.done() and not watcher.cancelled():
                    return  # the client went away; nobody to tell
                err = self._rpc_error(e)
                status = err.status
                yield (pending + "data: " + _dumps(err.body()) + "\n\n" + _DONE_EVENT).encode()
                return
            except APIError as err:
                status = err.status
                yield (pending + "data: " + _dumps(err.body()) + "\n\n" + _DONE_EVENT).encode()
                return
            if job.include_usage:
                pending += out.usage(self._usage(job, n))
            yield (pending + _DONE_EVENT).encode()
            clock.handed(shown)
            status = 200
        finally:
            watcher.cancel()
            call.cancel()
            m.running.dec()
            self._done(job, status)

    def _done(self, job: Job, status: int) -> None:
        self.metrics.requests.labels(job.endpoint, str(status)).inc()
        self.metrics.e2e_of[job.endpoint].observe(time.monotonic() - job.started)


async def _watch_disconnect(request: Request, call: GenerateCall) -> None:
    """Cancels the engine call as soon as the client disconnects (the body is already read, so the
    next ASGI message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            call.cancel()
            return


def _prompt_too_long(ctx: int, tokens: int, param: str, at_least: bool = False) -> APIError:
    """OpenAI's refusal of a prompt of the context's length or more (`at_least`: a lower bound
    of its tokens, from its length in bytes)."""
    has = f"at least {tokens}" if at_least else str(tokens)
    return APIError(400, f"This model's maximum context length is {ctx} tokens. However, your "
                    f"prompt has {has} tokens.", param=param, code="context_length_exceeded")


async def _read_body(receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
                     limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes. The rest of a body that is too large
    is still read, and dropped, before the answer: a client that sends its whole body before it
    reads the answer (the openai SDK does) would get a broken connection instead of the 413 if
    the server closed it early."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if chunk and size <= limit:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if size > limit:
        raise APIError(413, f"the request body is {size} bytes, more than this server takes "
                       f"({limit} bytes, exl3serve-openai --max-request-body-bytes)",
                       code="request_too_large")
    return b"".join(chunks)


def _invalid_body(e: ValidationError) -> APIError:
    """pydantic's first complaint about a body as a 400 naming the field (`param`)."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(400, "invalid request")
    loc = ".".join(str(x) for x in errs[0]["loc"])
    msg = errs[0]["msg"]
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


@dataclass
class GenerationEndpoint:
    """POST /v1/completions or /v1/chat/completions as an ASGI app of its own: the body read (up to
    --max-request-body-bytes) and validated by pydantic, the request prepared and answered (JSON or
    server-sent events), every refusal an OpenAI error body counted by its status."""
    fe: Frontend
    endpoint: str                        # completions | chat_completions
    body_type: type[BaseModel]
    make_job: Callable[[Any, Optional[str]], Awaitable[Job]]  # Frontend.completion_job | chat_job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        given = header(scope, b"x-request-id")
        echo = {"X-Request-Id": given.decode("latin-1")} if given else None
        try:
            raw = await _read_body(receive, self.fe.cfg.max_request_body_bytes)
            client_rid = client_request_id(None if given is None else given.decode("latin-1"),
                                           "X-Request-Id")
            try:
                body = self.body_type.model_validate_json(raw)
            except ValidationError as e:
                raise _invalid_body(e) from None
            await self.fe.need_engine()
            job = await self.make_job(body, client_rid)
        except ClientDisconnect:
            self.fe.metrics.requests.labels(self.endpoint, "499").inc()
            return
        except APIError as e:
            self.fe.metrics.requests.labels(self.endpoint, str(e.status)).inc()
            await JSONResponse(e.body(), status_code=e.status, headers=echo)(scope, receive, send)
            return
        except Exception:  # a bug: logged, and answered in OpenAI's error body all the same
            _log.exception("preparing a %s request failed", self.endpoint)
            self.fe.metrics.requests.labels(self.endpoint, "500").inc()
            err = APIError(500, "the front end failed to prepare the request (its log says why)")
            await JSONResponse(err.body(), status_code=500, headers=echo)(scope, receive, send)
            return
        try:
            response = await self.fe.answer(job, request)  # counts its own outcome
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
            entry = AccessLog(entry)
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
                cfg.max_model_len > fe.engine_context():
            message = (f"--max-model-len {cfg.max_model_len} is more than the engine's context "
                       f"({fe.engine_context()} tokens)")
            print(f"exl3serve-openai: {message}", file=sys.stderr, flush=True)
            raise SystemExit(message)
        yield
        fe.tokenizer_process.close()
        await fe.engine.close()

    app = _App(title="exl3serve OpenAI-compatible front end", lifespan=lifespan, generation={
        "/v1/completions": GenerationEndpoint(fe, "completions", CompletionRequest, fe.completion_job),
        "/v1/chat/completions": GenerationEndpoint(fe, "chat_completions", ChatCompletionRequest,
                                                   fe.chat_job),
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
        return Response(status_code=499)

    async def _parsed(request: Request, body_type: type[BaseModel]) -> Any:
        raw = await _read_body(request.receive, cfg.max_request_body_bytes)
        try:
            return body_type.model_validate_json(raw)
        except ValidationError as e:
            raise _invalid_body(e) from None

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await fe.tokenize(await _parsed(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return fe.detokenize(await _parsed(request, DetokenizeRequest))

    def _model_card() -> dict[str, Any]:
        return {"id": fe.model_name(), "object": "model", "created": fe.started,
                "owned_by": "exl3serve", "root": str(cfg.model_dir), "max_model_len": fe.max_context()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        await fe.engine.check()
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        await fe.engine.check()
        if model_id != fe.model_name():
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return _model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        up = await fe.engine.check()
        return JSONResponse({"status": "ok" if up else "engine unavailable",
                             "engine": cfg.engine}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(fe.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
