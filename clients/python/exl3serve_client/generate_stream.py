"""Many Generate requests on one `Generator.GenerateStream` call (proto/exl3serve/v1/exl3serve.proto).

    from exl3serve_client.generate_stream import GenerateStreamClient
    mux = GenerateStreamClient("127.0.0.1:50051")       # or a grpc.aio channel (then not closed here)
    call = mux.call(make_generate_request([1, 2, 3], max_tokens=16), timeout=60)
    while (resp := await call.read()) is not grpc.aio.EOF:
        ...                                             # pb.GenerateResponse, as Generate's messages
    await mux.close()

A StreamedCall is what the front end (frontend/engine_call.py) uses of grpc.aio's UnaryStreamCall for one
Generate call: read() gives each pb.GenerateResponse of the request in order, then grpc.aio.EOF once
the request ended with status 0; a request that ended with another status raises
grpc.aio.AioRpcError of that status from read() (after its last response, when that carries tokens
or a finish reason, as Generate's last message comes before the call's status). cancel() ends the
request (a CancelGenerate to the engine); read() then raises asyncio.CancelledError, as grpc.aio's
read() does after cancel(). A request's `timeout` is a deadline here (DEADLINE_EXCEEDED from read(),
and a cancel to the engine) and the request's timeout_us for the engine when the caller left it 0.

One GenerateStreamClient keeps at most one bidi call open: opened by the first call() and again by
the first call() after it broke. One task reads it and hands each update to its request (updates
for ids no longer open are dropped); one task writes the starts and cancels, in order. When the call
breaks (the engine went away or restarted), every request still open on it raises the break's
status (UNAVAILABLE, CANCELLED, ...) from read(); nothing is retried or reopened until the next
call(), so an engine that is away costs nothing but the calls made to it.
"""

from __future__ import annotations

import asyncio
import collections
import math
from typing import Any, AsyncIterator, Optional, Protocol, Union

import grpc
import grpc.aio

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc

from .client import open_channel
from .generate import CHANNEL_OPTIONS

_STATUS_OF = {c.value[0]: c for c in grpc.StatusCode}


class GenerateCall(Protocol):
    """What the front end reads one request through: grpc.aio's UnaryStreamCall of Generate, or a
    StreamedCall of GenerateStream."""

    async def read(self) -> Any: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# How a StreamedCall ended (its _end): _OK, _CANCELLED or a (grpc.StatusCode, details) pair.
_OK = "ok"
_CANCELLED = "cancelled"


class StreamedCall:
    """One request on a GenerateStream call: read(), cancel(), done(), as grpc.aio's call."""

    __slots__ = ("stream_id", "_conn", "_items", "_end", "_waiter", "_timer", "_sent")

    def __init__(self, conn: "_Conn", stream_id: int) -> None:
        self.stream_id = stream_id
        self._conn: Optional[_Conn] = conn    # None once ended: nothing more to send
        self._items: collections.deque[pb.GenerateResponse] = collections.deque()
        self._end: Union[None, str, tuple[grpc.StatusCode, str]] = None
        self._waiter: Optional[asyncio.Future[None]] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._sent = False                    # the start was handed to gRPC (a cancel must follow)

    async def read(self) -> Any:
        """The next pb.GenerateResponse; grpc.aio.EOF once the request ended with status 0. Raises
        grpc.aio.AioRpcError for any other end, asyncio.CancelledError after cancel()."""
        while True:
            if self._items:
                return self._items.popleft()
            end = self._end
            if end is not None:
                if end is _OK:
                    return grpc.aio.EOF
                if end is _CANCELLED:
                    raise asyncio.CancelledError()
                assert isinstance(end, tuple)
                raise rpc_error(end[0], end[1])
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                # As grpc.aio: a reader cancelled mid-read cancels the request.
                self.cancel()
                raise
            finally:
                self._waiter = None

    def cancel(self) -> bool:
        """Ends the request (the engine frees its sequence); False if it had already ended."""
        if self._end is not None:
            return False
        conn = self._conn
        self._items.clear()
        self._finish(_CANCELLED)
        if conn is not None and self._sent:
            conn.send(pb.GenerateAction(stream_id=self.stream_id, cancel=pb.CancelGenerate()))
        return True

    def done(self) -> bool:
        return self._end is not None

    def cancelled(self) -> bool:
        return self._end is _CANCELLED

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.GenerateResponse]:
        while (resp := await self.read()) is not grpc.aio.EOF:
            yield resp

    # ---- the multiplexer's side ------------------------------------------------------------
    def _update(self, u: pb.GenerateUpdate) -> None:
        """One update of this request from the reader."""
        resp = u.response
        if not u.last:
            self._items.append(resp)
        else:
            if resp.tokens or resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self._items.append(resp)
            code = u.status_code
            self._finish(_OK if code == 0 else
                         (_STATUS_OF.get(code, grpc.StatusCode.UNKNOWN), u.status_message))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self, end: Union[str, tuple[grpc.StatusCode, str]]) -> None:
        """Records how the request ended (the first end wins), forgets it and wakes its reader."""
        if self._end is not None:
            return
        self._end = end
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.calls.pop(self.stream_id, None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        """The request's deadline passed without its last update: DEADLINE_EXCEEDED, and a cancel."""
        self._timer = None
        if self._end is not None:
            return
        conn = self._conn
        self._finish((grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        if conn is not None and self._sent:
            conn.send(pb.GenerateAction(stream_id=self.stream_id, cancel=pb.CancelGenerate()))


class _Conn:
    """One GenerateStream bidi call and the requests open on it."""

    def __init__(self, stub: pb_grpc.GeneratorStub, on_broken: Any) -> None:
        self.call = stub.GenerateStream()
        self.calls: dict[int, StreamedCall] = {}
        self.next_id = 1
        self.broken = False
        self._on_broken = on_broken
        self._out: collections.deque[pb.GenerateAction] = collections.deque()
        self._out_wake: Optional[asyncio.Future[None]] = None
        self.reader = asyncio.ensure_future(self._read())
        self.writer = asyncio.ensure_future(self._write())

    def send(self, action: pb.GenerateAction) -> None:
        if self.broken:
            return
        self._out.append(action)
        wake = self._out_wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write(self) -> None:
        """The only task that writes the call: every start and cancel queued while the previous
        write was in flight goes out in one message, in order (a burst of new requests is one
        write here and one read on the engine's side); a start whose request ended before it went
        out is dropped."""
        loop = asyncio.get_running_loop()
        out = self._out
        call = self.call
        try:
            while True:
                while not out:
                    self._out_wake = loop.create_future()
                    await self._out_wake
                    self._out_wake = None
                msg = pb.GenerateStreamRequest()
                while out:
                    a = out.popleft()
                    if a.HasField("start"):
                        sc = self.calls.get(a.stream_id)
                        if sc is None:
                            continue  # cancelled or expired before it was sent
                        sc._sent = True
                    msg.actions.append(a)
                if msg.actions:
                    await call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call broke; the reader sees its status (or this one is it)
            self.break_with(_status_of(e))

    async def _read(self) -> None:
        """The only task that reads the call: each update to its request."""
        call = self.call
        calls = self.calls
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    n = len(calls)
                    self.break_with((grpc.StatusCode.UNAVAILABLE,
                                     f"the engine ended the GenerateStream call with {n} "
                                     "requests open") if n else None)
                    return
                for u in msg.updates:
                    sc = calls.get(u.stream_id)
                    if sc is not None:
                        sc._update(u)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.break_with(_status_of(e))

    def break_with(self, status: Optional[tuple[grpc.StatusCode, str]]) -> None:
        """The call is over: every request still on it ends with `status`; the next call() of the
        client opens a new call."""
        if self.broken:
            return
        self.broken = True
        self._on_broken(self)
        for sc in list(self.calls.values()):
            sc._finish(status or (grpc.StatusCode.UNAVAILABLE, "the GenerateStream call ended"))
        self.calls.clear()
        self._out.clear()
        self.call.cancel()
        current = asyncio.current_task()
        for task in (self.reader, self.writer):
            if task is not current:
                task.cancel()


def _status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code(), e.details() or ""
    return grpc.StatusCode.UNAVAILABLE, f"the GenerateStream call failed: {e!r}"


class GenerateStreamClient:
    """Generate requests multiplexed over one GenerateStream call; create it inside the running
    loop. `target` is HOST:PORT (a channel of its own, closed by close(); TLS keywords as
    AsyncGenerateClient) or a grpc.aio channel, which close() leaves open."""

    def __init__(self, target: Union[str, grpc.aio.Channel], **channel_kw: Any) -> None:
        if isinstance(target, str):
            self._channel = open_channel(grpc.aio, target, options=CHANNEL_OPTIONS, **channel_kw)
            self._own_channel = True
        else:
            self._channel = target
            self._own_channel = False
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._conn: Optional[_Conn] = None
        self._closed = False
        self.opened = 0   # GenerateStream calls opened so far

    def call(self, request: pb.GenerateRequest, timeout: Optional[float] = None) -> StreamedCall:
        """Starts one request on the call (opening it if none is open); `timeout` in seconds."""
        if self._closed:
            raise RuntimeError("GenerateStreamClient is closed")
        conn = self._conn
        if conn is None or conn.broken:
            conn = self._conn = _Conn(self._stub, self._forget)
            self.opened += 1
        sid = conn.next_id
        conn.next_id = sid + 1
        sc = StreamedCall(conn, sid)
        conn.calls[sid] = sc
        msg = pb.GenerateAction(stream_id=sid)
        msg.start.CopyFrom(request)
        if timeout is not None:
            if not request.timeout_us:
                msg.start.timeout_us = max(1, math.ceil(timeout * 1e6))
            loop = asyncio.get_running_loop()
            sc._timer = loop.call_at(loop.time() + timeout, sc._expire)
        conn.send(msg)
        return sc

    def open_requests(self) -> int:
        """Requests open on the current call."""
        conn = self._conn
        return 0 if conn is None or conn.broken else len(conn.calls)

    def _forget(self, conn: _Conn) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        """Cancels the call (every open request ends CANCELLED) and closes an own channel."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.break_with((grpc.StatusCode.CANCELLED, "the GenerateStreamClient was closed"))
            await asyncio.gather(conn.reader, conn.writer, return_exceptions=True)
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> "GenerateStreamClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
