"""The SSE stream: a streamed answer's events as the engine's messages arrive (stream_events, the
front end's hot path), and the ASGI response that writes them (SSEResponse)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Optional

import grpc
import grpc.aio
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from exl3serve.v1 import exl3serve_pb2 as pb

from .engine_call import _FAILED_FINISHES, FINISH_OF, EngineCall, RequestOutcome
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


async def stream_events(req: PreparedRequest, call: EngineCall, out: OpenAIRenderer,
                        tok: ModelTokenizer, metrics: FrontendMetrics,
                        outcome: RequestOutcome) -> AsyncGenerator[bytes, None]:
    """The streamed answer: one SSE event per engine message that adds text (a message carries
    every token the engine had ready for the request), as EngineCall.pieces would give them, with
    the per-token work inline: this loop is the front end's hot path. The last write ends with
    [DONE]. Closes the call and the outcome when it ends."""
    gen_tokens = metrics.generation_tokens
    detok = tok.detokenizer()
    add_bytes = getattr(detok, "add_bytes", None)  # byte-level BPE: the tokens' bytes
    token_bytes = tok.token_bytes
    stop = StopMatcher(req.stops) if req.stops else None
    want_lp = req.logprobs is not None
    calls = None if req.tool_use is None else req.tool_use.parser()  # text parsed for tool calls
    unspecified = pb.FINISH_REASON_UNSPECIFIED
    # What an engine message adds is one write: its events joined (chat's role event, as
    # OpenAI sends it first, with the first text event; the last text event with the finish,
    # the usage and [DONE]), written before the stream waits for the engine's next message.
    pending = out.role_event() if req.chat else ""
    clock = TokenClock(metrics, req.endpoint.value, req.started)
    try:
        n, offset = 0, 0
        resp = call.first
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
                finish: Optional[FinishReason] = None
                if stop is not None and stop.stopped:
                    call.call.cancel()
                    finish = FinishReason.STOP
                elif ended:
                    if resp.finish_reason in _FAILED_FINISHES:
                        raise await call.failed(resp.finish_reason)
                    finish = FINISH_OF.get(resp.finish_reason)
                n += k
                shown = 0  # tokens whose text this write hands to the client
                entries = out.logprob_entries(tokens) if want_lp else None
                if calls is not None:  # chat with tools: content and calls' deltas
                    if text or entries or finish is not None:
                        lp = None if not entries else out.logprobs(entries, offset)
                        pending += out.tool_call_events(calls.push(text, final=finish is not None),
                                                        lp)
                        shown = k
                    if finish is FinishReason.STOP and calls.calls:
                        finish = FinishReason.TOOL_CALLS
                elif text or entries:
                    lp = None if entries is None else out.logprobs(entries, offset)
                    offset += len(text)
                    pending += out.text_event(text, lp)
                    shown = k
                if finish is not None:
                    pending += out.finish_event(finish)
                    break
                if pending:
                    yield pending.encode()
                    pending = ""
                clock.handed(shown)
                resp = await call.call.read()
        except asyncio.CancelledError:
            if call.client_gone:
                return  # the client went away and the watcher cancelled the call
            raise
        except grpc.aio.AioRpcError as e:
            if call.client_gone:
                return  # the client went away; nobody to tell
            err = call.engine.rpc_error(e)
            outcome.failed(err.status)
            yield (pending + error_event(err) + DONE_EVENT).encode()
            return
        except APIError as err:
            outcome.failed(err.status)
            yield (pending + error_event(err) + DONE_EVENT).encode()
            return
        if req.include_usage:
            pending += out.usage_event(n)
        yield (pending + DONE_EVENT).encode()
        clock.handed(shown)
        outcome.complete()
    finally:
        call.close()
        outcome.close()
