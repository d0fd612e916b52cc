"""A fake of the engine's Generator service for tests without exl3-router: a grpc.aio server whose
GenerateStream steps its requests as the engine does (one message per step with the updates of
every request that had something) and whose Generate runs the same script for one request; each
request is scripted by its first prompt token, or, where its request_id is a key of `replies`, gives
those tokens (one per step, then finish STOP; LENGTH at max_tokens) whatever its prompt."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Optional

import grpc
import grpc.aio

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc

# The first prompt token says what the fake engine does with a request.
RUN = 1          # max_tokens tokens, one per step (token i: prompt[1] + i), then finish LENGTH, status 0
REFUSE = 2       # at once: a last update without tokens, INVALID_ARGUMENT
FAIL_AFTER = 3   # two tokens, then a last update with one more token, finish ABORT and INTERNAL
HANG = 4         # a token, then nothing until it is cancelled
BURST = 5        # all max_tokens tokens in one update with the finish (status 0)
OVERLOAD = 6     # at once: a last update without tokens, RESOURCE_EXHAUSTED


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class FakeEngine(pb_grpc.GeneratorServicer):
    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.opened = 0                      # GenerateStream calls
        self.starts: list[pb.GenerateRequest] = []
        self.cancels: list[int] = []
        self.messages = 0                    # GenerateStreamRequest messages read
        self.open_calls = 0
        self.break_status: Optional[tuple[grpc.StatusCode, str]] = None  # set: every call aborts
        self.stray: list[pb.GenerateUpdate] = []  # sent on the next step as they are
        self.replies: dict[str, list[int]] = {}   # request_id -> the tokens it answers

    async def DescribeModel(self, request: Any, context: Any) -> pb.DescribeModelResponse:
        return pb.DescribeModelResponse(model="fake", vocab_size=512, max_context=4096)

    async def Generate(self, request: pb.GenerateRequest, context: Any):
        """The same script for one request, as Generate sends it: each update's response, and a
        last update's status as the call's."""
        self.starts.append(request)
        st: dict[str, Any] = {"req": request, "n": 0, "cancel": False,
                              "reply": self.replies.get(request.request_id)}
        try:
            while True:
                u = self._step(0, st)
                if u is not None:
                    if not u.last or u.response.tokens or u.response.finish_reason:
                        yield u.response
                    if u.last:
                        if u.status_code:
                            await context.abort(_CODES[u.status_code],
                                                u.status_message)
                        return
                await asyncio.sleep(self.step_s)
        except asyncio.CancelledError:
            self.cancels.append(0)
            raise

    async def GenerateStream(self, request_iterator: Any, context: Any):
        self.opened += 1
        self.open_calls += 1
        inbox: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            async for m in request_iterator:
                self.messages += 1
                for a in m.actions:
                    await inbox.put(a)
            await inbox.put(None)
        pumping = asyncio.ensure_future(pump())
        active: dict[int, dict[str, Any]] = {}
        half_closed = False
        try:
            while True:
                if self.break_status is not None:
                    await context.abort(*self.break_status)
                while not inbox.empty():
                    m = inbox.get_nowait()
                    if m is None:
                        half_closed = True
                    elif m.HasField("start"):
                        self.starts.append(m.start)
                        active[m.stream_id] = {"req": m.start, "n": 0, "cancel": False,
                                               "reply": self.replies.get(m.start.request_id)}
                    else:
                        self.cancels.append(m.stream_id)
                        if m.stream_id in active:
                            active[m.stream_id]["cancel"] = True
                updates = list(self.stray)
                self.stray.clear()
                for sid, st in list(active.items()):
                    u = self._step(sid, st)
                    if u is not None:
                        updates.append(u)
                        if u.last:
                            del active[sid]
                if updates:
                    yield pb.GenerateStreamResponse(updates=updates)
                if half_closed and not active:
                    return
                await asyncio.sleep(self.step_s)
        finally:
            pumping.cancel()
            self.open_calls -= 1

    @staticmethod
    def _step(sid: int, st: dict[str, Any]) -> Optional[pb.GenerateUpdate]:
        req: pb.GenerateRequest = st["req"]
        kind = req.prompt_token_ids[0]
        base = req.prompt_token_ids[1] if len(req.prompt_token_ids) > 1 else 0
        if st["cancel"]:
            return pb.GenerateUpdate(stream_id=sid, last=True, status_code=grpc.StatusCode.CANCELLED.value[0],
                                     response=pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT))
        n = st["n"]
        reply = st.get("reply")
        if reply is not None:
            st["n"] = n + 1
            t = [pb.GeneratedToken(token_id=reply[n])]
            if n + 1 == len(reply) or n + 1 == req.max_tokens:
                finish = pb.FINISH_REASON_STOP if n + 1 == len(reply) else pb.FINISH_REASON_LENGTH
                return pb.GenerateUpdate(stream_id=sid, last=True, response=pb.GenerateResponse(
                    tokens=t, finish_reason=finish, usage=pb.Usage(completion_tokens=n + 1)))
            return pb.GenerateUpdate(stream_id=sid, response=pb.GenerateResponse(tokens=t))
        tok = lambda i: pb.GeneratedToken(token_id=base + i)  # noqa: E731
        if kind == REFUSE:
            return pb.GenerateUpdate(stream_id=sid, last=True,
                                     status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     status_message="max_tokens must be > 0")
        if kind == OVERLOAD:
            return pb.GenerateUpdate(stream_id=sid, last=True,
                                     status_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                     status_message="more than max_pending_requests (1) waiting")
        if kind == BURST:
            return pb.GenerateUpdate(stream_id=sid, last=True, response=pb.GenerateResponse(
                tokens=[tok(i) for i in range(req.max_tokens)], finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(completion_tokens=req.max_tokens)))
        if kind == HANG:
            if n > 0:
                return None
            st["n"] = 1
            return pb.GenerateUpdate(stream_id=sid, response=pb.GenerateResponse(tokens=[tok(0)]))
        if kind == FAIL_AFTER and n == 2:
            return pb.GenerateUpdate(stream_id=sid, last=True,
                                     status_code=grpc.StatusCode.INTERNAL.value[0],
                                     status_message="lost experts",
                                     response=pb.GenerateResponse(tokens=[tok(n)],
                                                                  finish_reason=pb.FINISH_REASON_ABORT))
        st["n"] = n + 1
        if kind == RUN and n + 1 == req.max_tokens:
            return pb.GenerateUpdate(stream_id=sid, last=True, response=pb.GenerateResponse(
                tokens=[tok(n)], finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(completion_tokens=req.max_tokens)))
        return pb.GenerateUpdate(stream_id=sid, response=pb.GenerateResponse(tokens=[tok(n)]))


class Server:
    """The fake engine on 127.0.0.1:port (port 0: a free one); stop() and start() again on the same
    port stand for an engine restart."""

    def __init__(self, engine: FakeEngine, port: int = 0) -> None:
        self.engine = engine
        self.port = port
        self.server: Optional[grpc.aio.Server] = None

    async def start(self) -> "Server":
        self.server = grpc.aio.server()
        pb_grpc.add_GeneratorServicer_to_server(self.engine, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


class ThreadedServer:
    """The fake engine served from a thread of its own (its own event loop), for tests that drive
    a front-end process with blocking clients; stop() and start() again keep the port."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(engine)

    def _do(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def start(self) -> "ThreadedServer":
        self._do(self.server.start())
        return self

    def stop(self) -> None:
        self._do(self.server.stop())

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    @property
    def target(self) -> str:
        return self.server.target
