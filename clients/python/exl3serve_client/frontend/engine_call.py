"""The engine call: the engine's channel and what it says of itself (Engine), one request's call to
it (EngineCall: sent, its first message awaited, cancelled when the client goes away, its
messages read as text), the engine's refusals as HTTP answers, and one request's entry in the
metrics (RequestOutcome)."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import grpc
import grpc.aio

from exl3serve.v1 import exl3serve_pb2 as pb

from ..generate import FINISH_REASONS, AsyncGenerateClient
from ..generate_stream import GenerateCall, GenerateStreamClient
from .metrics import FrontendMetrics
from .protocol import CLIENT_CLOSED_REQUEST, APIError, FinishReason
from .text import Detokenizer, StopMatcher
from .validation import PreparedRequest
from .vllm_metrics import VllmRequest

# gRPC status -> HTTP status of the answer.
_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: CLIENT_CLOSED_REQUEST,
}

# The request fields the engine's refusals name first (engine/core/engine.cc, Engine::Validate:
# "min_tokens must be in [0, max_tokens], not 9", "stop_token_ids token 0 is 999, outside ...").
_ENGINE_FIELDS = ("max_tokens", "min_tokens", "stop_token_ids", "temperature", "top_p", "top_k",
                  "min_p", "repetition_penalty", "presence_penalty", "logprobs", "logit_bias",
                  "num_speculative_tokens")

ENGINE_CALLS = ("stream", "per-request")

# The engine's finish reasons that end a request without an answer (the call's status says why).
_FAILED_FINISHES = frozenset({pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR})
# The engine's finish reasons that complete an answer, as OpenAI names them.
FINISH_OF = {pb.FINISH_REASON_STOP: FinishReason.STOP, pb.FINISH_REASON_LENGTH: FinishReason.LENGTH}


def _engine_param(details: str) -> Optional[str]:
    """The OpenAI error's `param` for an engine refusal: the field its message starts with."""
    for name in _ENGINE_FIELDS:
        if details.startswith(name + " "):
            return name
    if details.startswith(("the prompt ", "prompt token ", "prompt (")):
        return "prompt"
    return None


class Engine:
    """The engine's channel and what DescribeModel said; refreshed while the engine is away.
    `calls` starts the requests: engine_calls "stream" puts them all on one GenerateStream call
    (generate_stream.py, on the same channel), "per-request" makes one Generate call each.
    The served model's name and context follow what the engine said, within the options."""

    def __init__(self, target: str, engine_calls: str, health_cache_s: float,
                 metrics: FrontendMetrics, model_dir_name: str, config_max_context: int,
                 served_model_name: Optional[str], max_model_len: Optional[int]) -> None:
        if engine_calls not in ENGINE_CALLS:
            raise ValueError(f"engine_calls must be one of {ENGINE_CALLS}, not {engine_calls!r}")
        self.target = target
        self.engine_calls = engine_calls
        self.health_cache_s = health_cache_s
        self.metrics = metrics
        self.model_dir_name = model_dir_name  # the model's name while the engine has said none
        self.config_max_context = config_max_context
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.client: Optional[AsyncGenerateClient] = None
        self.calls: Optional[Union[AsyncGenerateClient, GenerateStreamClient]] = None
        self.info: Optional[pb.DescribeModelResponse] = None
        self.up = False
        self._checked = 0.0
        self.open_calls: set["EngineCall"] = set()  # the calls of the answers under way

    def end_open_calls(self) -> None:
        """The server's shutdown is about to cut the answers still under way: each call ends,
        and its answer with SHUTTING_DOWN (a stream's error event and [DONE], a whole answer's
        503) instead of a cut connection."""
        for call in list(self.open_calls):
            call.end_for_shutdown()

    async def open(self) -> None:
        self.client = AsyncGenerateClient(self.target)
        self.calls = GenerateStreamClient(self.client.channel) \
            if self.engine_calls == "stream" else self.client

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
        if not force and now - self._checked < self.health_cache_s:
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

    async def refresh_stats(self) -> None:
        """Asks the engine for its state (Generator.EngineStats) for the scrape under way: vLLM's
        engine series show its answer, or are left out when it does not answer within a second."""
        self.metrics.engine_stats.update(await self.engine_stats(), self.model_name())

    async def engine_stats(self) -> Optional[pb.EngineStatsResponse]:
        """The engine's state (Generator.EngineStats); None where it does not answer within a
        second."""
        if self.client is None:
            return None
        try:
            return await self.client.engine_stats(timeout=1.0)
        except Exception:  # away, or an engine without EngineStats
            return None

    async def need(self) -> None:
        """Refuses (503) while the engine is away."""
        if not self.up and not await self.check(force=True):
            raise APIError(503, "the engine is unavailable", code="engine_unavailable")

    # ---- the served model --------------------------------------------------------------------
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.info is not None and self.info.model:
            return self.info.model
        return self.model_dir_name

    def engine_context(self) -> int:
        if self.info is not None and self.info.max_context:
            return int(self.info.max_context)
        return self.config_max_context or 4096

    def max_context(self) -> int:
        """Tokens of prompt and completion together at most: --max-model-len, within the engine's."""
        ctx = self.engine_context()
        return min(ctx, self.max_model_len) if self.max_model_len else ctx

    # ---- refusals ----------------------------------------------------------------------------
    def rpc_error(self, e: grpc.aio.AioRpcError) -> APIError:
        """A failed call as the HTTP answer."""
        status = _HTTP_OF.get(e.code(), 500)
        if status == 503:
            self.mark(False)
            return APIError(503, f"the engine is unavailable: {e.details()}", code="engine_unavailable")
        if status == 504:
            return APIError(504, f"the request timed out: {e.details()}", code="timeout")
        if status == 429:
            return APIError(429, f"the engine is overloaded: {e.details()}", code="overloaded")
        details = e.details() or e.code().name
        if e.code() == grpc.StatusCode.UNIMPLEMENTED and self.engine_calls == "stream":
            details = ("the engine does not serve Generator.GenerateStream (an older exl3-router?): "
                       f"run the front end with --engine-calls per-request ({details})")
        return APIError(status, details, param=_engine_param(details) if status == 400 else None)


async def _watch_disconnect(receive: Any, calls: list[GenerateCall]) -> None:
    """Cancels the request's engine calls as soon as the client disconnects (the body is already
    read, so the next ASGI message is the disconnect)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            for call in calls:
                call.cancel()
            return


@dataclass
class Piece:
    """What one engine message adds to the answer."""
    text: str
    tokens: list[Any]
    finish: Optional[FinishReason]
    prompt_logprobs: Any = ()  # the engine's GenerateResponse.prompt_logprobs (first message)
    cached_tokens: int = 0     # the prompt tokens the prefix cache served (last message)


def shutting_down() -> APIError:
    """The answer of a request that the server's shutdown ended (Engine.end_open_calls)."""
    return APIError(503, "the server is shutting down: the request was ended before its answer "
                    "was complete", code="server_shutting_down")


class EngineCall:
    """One choice's call to the engine, started with start_all() (a call per choice of the
    request): the requests sent and the engine's first message of each read, so that a refusal
    becomes the HTTP status; one task watching the client cancels the request's calls when it goes
    away."""

    def __init__(self, engine: Engine, call: GenerateCall, first: Any,
                 watcher: asyncio.Task, vllm: VllmRequest) -> None:
        self.engine = engine
        self.call = call
        self.first = first
        self.watcher = watcher
        self.vllm = vllm  # the request in vLLM's series: message() per engine message
        self.shut_down = False  # ended by the server's shutdown (end_for_shutdown)
        engine.open_calls.add(self)

    @classmethod
    async def start_all(cls, engine: Engine, req: PreparedRequest, receive: Any,
                        timeout_s: float) -> list["EngineCall"]:
        """The request's calls, one per choice (PreparedRequest.choice_requests); if the engine
        refuses one, the others are cancelled and the refusal raised."""
        if engine.calls is None:
            raise APIError(503, "the engine is not connected")
        requests = req.choice_requests()
        calls = [engine.calls.call(r, timeout=timeout_s) for r in requests]
        watcher = asyncio.ensure_future(_watch_disconnect(receive, calls))
        try:
            if len(calls) == 1:
                firsts = [await calls[0].read()]
            else:
                firsts = await asyncio.gather(*(c.read() for c in calls))
        except grpc.aio.AioRpcError as e:
            watcher.cancel()
            for c in calls:
                c.cancel()
            raise engine.rpc_error(e) from None
        except BaseException:
            watcher.cancel()
            for c in calls:
                c.cancel()
            raise
        engine.mark(True)
        vllm, model = engine.metrics.vllm, engine.model_name()
        # A prompt's `n` is counted once, by its first choice (vLLM counts the parent request).
        return [cls(engine, c, first, watcher,
                    vllm.request(model, req.started, r, req.n if i % req.n == 0 else None))
                for i, (c, first, r) in enumerate(zip(calls, firsts, requests))]

    @property
    def client_gone(self) -> bool:
        """The client disconnected (and the watcher cancelled the call)."""
        return self.watcher.done() and not self.watcher.cancelled()

    def close(self) -> None:
        """Ends the call (and the request's watcher: close every choice's call together)."""
        self.watcher.cancel()
        self.call.cancel()
        self.vllm.close()
        self.engine.open_calls.discard(self)

    def end_for_shutdown(self) -> None:
        """Cancels the call for the server's shutdown: its read raises CancelledError, which the
        answer turns into shutting_down()."""
        self.shut_down = True
        self.call.cancel()

    async def failed(self, finish: pb.FinishReason) -> APIError:
        """The answer's error for a message that ends the request with `finish` (abort, error):
        the call's status says why (deadline, lost experts), which read() raises."""
        await self.call.read()
        return APIError(500, "the engine ended the request "
                        f"({FINISH_REASONS.get(finish)})")

    async def pieces(self, detok: Detokenizer, stop: StopMatcher,
                     metrics: FrontendMetrics) -> AsyncIterator[Piece]:
        """The answer's text as the engine's messages arrive; stops at a stop string (cancelling the
        engine request) or at the engine's finish."""
        resp = self.first
        while resp is not grpc.aio.EOF:
            ended = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            text = detok.add(t.token_id for t in resp.tokens)
            if ended:
                text += detok.finish()
            text = stop.push(text, final=ended)
            k = len(resp.tokens)
            metrics.generation_tokens.inc(k)
            self.vllm.message(resp, k, stop.stopped)
            if stop.stopped:
                self.call.cancel()
                yield Piece(text, list(resp.tokens), FinishReason.STOP, resp.prompt_logprobs)
                return
            if resp.finish_reason in _FAILED_FINISHES:
                raise await self.failed(resp.finish_reason)
            yield Piece(text, list(resp.tokens), FINISH_OF.get(resp.finish_reason),
                        resp.prompt_logprobs, resp.usage.cached_tokens if ended else 0)
            if ended:
                return
            resp = await self.call.read()
        raise APIError(500, "the engine's stream ended without a finish reason")


class AnswerEnd(enum.Enum):
    """How a request's answer ended, as the requests counter counts it."""
    CLIENT_GONE = enum.auto()  # until the answer is complete, a closing client is why it ends
    COMPLETE = enum.auto()     # answered 200 to its end
    FAILED = enum.auto()       # answered with an error (its HTTP status)


class RequestOutcome:
    """One generation request in the metrics: running from its start until close(), then counted
    once under its HTTP status (CLIENT_CLOSED_REQUEST unless it completed or failed) with its
    end-to-end time."""

    def __init__(self, metrics: FrontendMetrics, req: PreparedRequest) -> None:
        self.metrics = metrics
        self.req = req
        self.end = AnswerEnd.CLIENT_GONE
        self.failed_status = 500
        metrics.running.inc()
        metrics.prompt_tokens.inc(req.prompt_tokens)

    def complete(self) -> None:
        self.end = AnswerEnd.COMPLETE

    def client_gone(self) -> None:
        self.end = AnswerEnd.CLIENT_GONE

    def failed(self, status: int) -> None:
        self.end = AnswerEnd.FAILED
        self.failed_status = status

    def status(self) -> int:
        if self.end is AnswerEnd.COMPLETE:
            return 200
        if self.end is AnswerEnd.FAILED:
            return self.failed_status
        return CLIENT_CLOSED_REQUEST

    def close(self) -> None:
        m = self.metrics
        m.running.dec()
        endpoint = self.req.endpoint.value
        m.requests.labels(endpoint, str(self.status())).inc()
        m.e2e_of[endpoint].observe(time.monotonic() - self.req.started)

