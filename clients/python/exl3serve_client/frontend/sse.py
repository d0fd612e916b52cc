"""The SSE stream: a streamed answer's events as the engine's messages arrive (stream_events, the
front end's hot path), and the ASGI response that writes them (SSEResponse)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional

import grpc
import grpc.aio
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from exl3serve.v1 import exl3serve_pb2 as pb

from .answer_text import AnswerTextParser
from .engine_call import _FAILED_FINISHES, FINISH_OF, EngineCall, RequestOutcome, shutting_down
from .metrics import FrontendMetrics, TokenClock
from .protocol import APIError, FinishReason
from .render import DONE_EVENT, OpenAIRenderer, error_event
from .text import ModelTokenizer, StopMatcher
from .validation import PreparedRequest

_DONE = DONE_EVENT.encode()


class SSEResponse(Response):
    """A streamed answer: its events (bytes) written as they come. Starlette's StreamingResponse
    does the same but runs a task group listening for the client's disconnect; here the disconnect
    is EngineCall's watcher's (it cancels the engine call, which ends the events)."""

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


@dataclass
class _Choice:
    """One choice's stream: its tokens so far, and events made but not yet written when it failed."""
    tokens: int = 0
    unsent: str = ""
    cached_tokens: int = 0  # the prompt tokens the prefix cache served (the engine's last message)


async def _choice_events(req: PreparedRequest, call: EngineCall, out: OpenAIRenderer,
                         tok: ModelTokenizer, metrics: FrontendMetrics, clock: TokenClock,
                         state: _Choice) -> AsyncGenerator[tuple[str, bool], None]:
    """One choice's events as its engine messages arrive: one (events, last) per engine message
    that adds text (a message carries every token the engine had ready for the request), the last
    with the finish, with the per-token work inline: this loop is the front end's hot path.
    Returns without its last events when the client went away; raises APIError or the call's
    AioRpcError when the answer fails (state.unsent: the events made before)."""
    gen_tokens = metrics.generation_tokens
    vllm = call.vllm
    detok = tok.detokenizer()
    add_bytes = getattr(detok, "add_bytes", None)  # byte-level BPE: the tokens' bytes
    token_bytes = tok.token_bytes
    stop = StopMatcher(req.stops) if req.stops else None
    want_lp = req.logprobs is not None
    # chat with tools or the reasoning split: the text parsed into content, reasoning and calls
    parsed = AnswerTextParser(req) if req.tool_use is not None or req.reasoning is not None \
        else None
    unspecified = pb.FINISH_REASON_UNSPECIFIED
    # What an engine message adds is one write: its events joined (chat's role event, as
    # OpenAI sends it first, with the first text event; the last text event with the finish),
    # written before the stream waits for the engine's next message.
    pending = out.role_event() if req.chat else ""
    offset = 0
    resp = call.first
    # completions' echo: the prompt's text (and logprobs) start the first text event; with
    # max_tokens 0 (echo.only) the engine's one token is left out.
    echo = req.echo
    echo_text = None if echo is None else echo.texts[req.prompt_of(out.index)]
    echo_only = echo is not None and echo.only
    try:
        while True:
            if resp is grpc.aio.EOF:
                raise APIError(500, "the engine's stream ended without a finish reason")
            tokens: Any = resp.tokens if not echo_only else []
            k = len(tokens)
            ended = resp.finish_reason != unspecified
            if ended:
                state.cached_tokens = resp.usage.cached_tokens
            if k == 0:
                text = ""
            elif add_bytes is not None:
                if k == 1:
                    text = add_bytes(token_bytes(tokens[0].token_id))
                else:
                    text = add_bytes(b"".join([token_bytes(t.token_id) for t in tokens]))
            else:
                text = detok.add([t.token_id for t in tokens])
            if ended and not echo_only:
                text += detok.finish()
            if stop is not None:
                text = stop.push(text, final=ended)
            gen_tokens.inc(k)
            finish: Optional[FinishReason] = None
            vllm.message(resp, k, stop is not None and stop.stopped)
            if stop is not None and stop.stopped:
                call.call.cancel()
                finish = FinishReason.STOP
            elif ended:
                if resp.finish_reason in _FAILED_FINISHES:
                    raise await call.failed(resp.finish_reason)
                finish = FinishReason.LENGTH if echo_only else FINISH_OF.get(resp.finish_reason)
            state.tokens += k
            shown = 0  # tokens whose text this write hands to the client
            entries = out.logprob_entries(tokens) if want_lp else None
            if echo_text is not None:
                text = echo_text + text
                if entries is not None:
                    prompt = req.prompts[req.prompt_of(out.index)]
                    entries = out.echo_entries(prompt, resp.prompt_logprobs) + entries
                echo_text = None
            if parsed is not None:  # chat with tools or reasoning: their deltas
                if text or entries or finish is not None:
                    lp = None if not entries else out.logprobs(entries, offset)
                    pending += out.delta_events(parsed.push(text, final=finish is not None), lp)
                    shown = k
                if finish is FinishReason.STOP and parsed.called:
                    finish = FinishReason.TOOL_CALLS
            elif text or entries:
                lp = None if entries is None else out.logprobs(entries, offset)
                offset += len(text)
                pending += out.text_event(text, lp)
                shown = k
            if finish is not None:
                pending += out.finish_event(finish)
                clock.handed(shown)
                yield pending, True
                return
            if pending:
                yield pending, False
                pending = ""
            clock.handed(shown)
            resp = await call.call.read()
    except asyncio.CancelledError:
        if call.client_gone:
            return  # the client went away and the watcher cancelled the call
        if call.shut_down:  # the server's shutdown ended it: the stream ends with the error
            state.unsent = pending
            raise shutting_down() from None
        raise
    except grpc.aio.AioRpcError:
        if call.client_gone:
            return  # the client went away; nobody to tell
        state.unsent = pending
        raise
    except APIError:
        state.unsent = pending
        raise


async def stream_events(req: PreparedRequest, calls: list[EngineCall],
                        outs: list[OpenAIRenderer], tok: ModelTokenizer,
                        metrics: FrontendMetrics,
                        outcome: RequestOutcome) -> AsyncGenerator[bytes, None]:
    """The streamed answer: its choices' events (_choice_events), interleaved as they come where
    the request has several, each chunk's choice by its index. The last write ends with the usage
    (all choices' tokens) and [DONE]. A choice that fails ends the stream with the error (the
    other choices' calls cancelled). Closes the calls and the outcome when it ends."""
    clock = TokenClock(metrics, req.endpoint.value, req.started)
    states = [_Choice() for _ in calls]
    try:
        events = _choice_events(req, calls[0], outs[0], tok, metrics, clock, states[0]) \
            if len(calls) == 1 else _interleaved(req, calls, outs, tok, metrics, clock, states)
        try:
            async for text, last in events:
                if last:  # written below with the usage and [DONE]
                    break
                if text:
                    yield text.encode()
            else:
                return  # the client went away
        except (grpc.aio.AioRpcError, APIError) as e:
            err = calls[0].engine.rpc_error(e) if isinstance(e, grpc.aio.AioRpcError) else e
            outcome.failed(err.status)
            unsent = "".join(s.unsent for s in states)
            yield (unsent + error_event(err) + DONE_EVENT).encode()
            return
        if req.include_usage:
            cached = sum(s.cached_tokens for i, s in enumerate(states) if i % req.n == 0)
            text += outs[0].usage_event(sum(s.tokens for s in states), cached)
        yield (text + DONE_EVENT).encode()
        outcome.complete()
    finally:
        await events.aclose()
        for call in calls:
            call.close()
        outcome.close()


async def _interleaved(req: PreparedRequest, calls: list[EngineCall],
                       outs: list[OpenAIRenderer], tok: ModelTokenizer,
                       metrics: FrontendMetrics, clock: TokenClock,
                       states: list[_Choice]) -> AsyncGenerator[tuple[str, bool], None]:
    """Several choices' events as they come, as _choice_events gives one choice's: each write all
    that the choices have ready, `last` with the last choice's finish; ends without it where the
    client went away. The first choice to fail raises (the others are cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = object()  # a choice's end without its finish: the client went away

    async def run(i: int) -> None:
        last = False
        try:
            async for text, last in _choice_events(req, calls[i], outs[i], tok, metrics, clock,
                                                   states[i]):
                await queue.put((text, last))
        except (grpc.aio.AioRpcError, APIError) as e:
            await queue.put(e)
            return
        if not last:
            await queue.put(gone)

    tasks = [asyncio.ensure_future(run(i)) for i in range(len(calls))]
    try:
        running = len(tasks)
        while running:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            text = ""
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is gone:
                    return
                text += item[0]
                running -= item[1]
            yield text, running == 0
    finally:
        for t in tasks:
            t.cancel()
