"""GenerateStreamClient (clients/python/exl3serve_client/generate_stream.py) against the fake engine
of fake_engine.py (a grpc.aio server in this process, each request scripted by its first prompt
token): ordering, many concurrent requests, cancel, refusals, an error after tokens, deadlines, a
broken call and an engine restart."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import grpc
import grpc.aio
import pytest

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc
from exl3serve_client import make_generate_request
from exl3serve_client.generate_stream import GenerateStreamClient

from fake_engine import BURST, FAIL_AFTER, HANG, REFUSE, RUN, FakeEngine, Server


def req(kind: int, max_tokens: int = 4, base: int = 0, **kw: Any) -> pb.GenerateRequest:
    return make_generate_request([kind, base], max_tokens=max_tokens, **kw)


async def read_all(call: Any) -> list[pb.GenerateResponse]:
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def run(coro_fn, step_s: float = 0.002) -> Any:
    """coro_fn(engine, server, mux) on a fresh loop with a fake engine and a client of it."""
    async def main() -> Any:
        engine = FakeEngine(step_s)
        server = await Server(engine).start()
        mux = GenerateStreamClient(server.target)
        try:
            return await asyncio.wait_for(coro_fn(engine, server, mux), 30)
        finally:
            await mux.close()
            await server.stop()
    return asyncio.run(main())


def test_one_request_in_order_then_eof():
    async def body(engine, server, mux):
        call = mux.call(req(RUN, 5, base=100))
        got = await read_all(call)
        assert [t.token_id for r in got for t in r.tokens] == [100, 101, 102, 103, 104]
        assert [r.finish_reason for r in got] == [0] * 4 + [pb.FINISH_REASON_LENGTH]
        assert got[-1].usage.completion_tokens == 5
        assert call.done() and not call.cancel()
        assert await call.read() is grpc.aio.EOF  # again, as grpc.aio after the end
        assert mux.open_requests() == 0
    run(body)


def test_many_concurrent_requests_one_call():
    """64 requests of different lengths at once: each gets exactly its own tokens, in order, and
    they all share one GenerateStream call whose messages carry many updates."""
    async def body(engine, server, mux):
        async def one(i: int) -> list[int]:
            call = mux.call(req(RUN, 3 + i % 7, base=1000 * i))
            return [t.token_id for r in await read_all(call) for t in r.tokens]
        results = await asyncio.gather(*[one(i) for i in range(64)])
        for i, ids in enumerate(results):
            assert ids == [1000 * i + k for k in range(3 + i % 7)], i
        assert engine.opened == 1 and mux.opened == 1
        assert mux.open_requests() == 0
        # The 64 starts, queued in one pass of the loop, went out together: one message, not 64.
        assert engine.messages == 1, engine.messages
        # A second wave reuses the call.
        await asyncio.gather(*[one(i) for i in range(8)])
        assert engine.opened == 1
    run(body)


def test_burst_and_async_for():
    async def body(engine, server, mux):
        got = [r async for r in mux.call(req(BURST, 6, base=7))]
        assert len(got) == 1 and [t.token_id for t in got[0].tokens] == list(range(7, 13))
    run(body)


def test_refusal_raises_its_status():
    async def body(engine, server, mux):
        call = mux.call(req(REFUSE))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "max_tokens must be > 0"
        assert call.done()
        with pytest.raises(grpc.aio.AioRpcError):  # and again
            await call.read()
        # The call goes on for the others.
        assert len(await read_all(mux.call(req(RUN, 2)))) == 2
        assert engine.opened == 1
    run(body)


def test_error_after_tokens():
    """The last update with tokens, finish ABORT and a status: its response first, then the status,
    as Generate's last message and then the call's status."""
    async def body(engine, server, mux):
        call = mux.call(req(FAIL_AFTER, 10, base=50))
        got = [await call.read() for _ in range(3)]
        assert [t.token_id for r in got for t in r.tokens] == [50, 51, 52]
        assert got[-1].finish_reason == pb.FINISH_REASON_ABORT
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INTERNAL, "lost experts")
    run(body)


def test_cancel():
    """cancel() sends one CancelGenerate for the request; read() then raises CancelledError (as
    grpc.aio's); the request is forgotten and the engine's last update for it ignored."""
    async def body(engine, server, mux):
        call = mux.call(req(HANG))
        other = mux.call(req(RUN, 30))
        assert (await call.read()).tokens[0].token_id == 0
        pending = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.02)
        assert call.cancel() and not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert call.done() and call.cancelled()
        assert mux.open_requests() == 1
        assert len(await read_all(other)) == 30
        assert engine.cancels == [call.stream_id]
    run(body)


def test_cancel_before_sent_sends_nothing():
    async def body(engine, server, mux):
        warm = mux.call(req(RUN, 1))
        await read_all(warm)
        call = mux.call(req(HANG))
        call.cancel()                                   # before the writer ran
        await read_all(mux.call(req(RUN, 2)))
        assert [r.prompt_token_ids[0] for r in engine.starts] == [RUN, RUN]
        assert engine.cancels == []
    run(body)


def test_cancelled_reader_task_cancels_the_request():
    async def body(engine, server, mux):
        call = mux.call(req(HANG))
        await call.read()
        task = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled()
        for _ in range(100):
            if engine.cancels:
                break
            await asyncio.sleep(0.01)
        assert engine.cancels == [call.stream_id]
    run(body)


def test_deadline():
    """No last update by the timeout: DEADLINE_EXCEEDED from read() and a cancel to the engine; the
    request's timeout_us is set from the timeout when the caller left it 0, kept otherwise."""
    async def body(engine, server, mux):
        t0 = time.monotonic()
        call = mux.call(req(HANG), timeout=0.3)
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        took = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 < took < 2.0, took
        for _ in range(100):
            if engine.cancels:
                break
            await asyncio.sleep(0.01)
        assert engine.cancels == [call.stream_id]
        assert engine.starts[0].timeout_us == 300000
        await read_all(mux.call(req(RUN, 2, timeout_us=1234), timeout=5))
        assert engine.starts[1].timeout_us == 1234
        assert mux.open_requests() == 0
        await read_all(mux.call(req(RUN, 2)))           # no timeout: none set
        assert engine.starts[2].timeout_us == 0
    run(body)


def test_updates_for_unknown_ids_ignored():
    async def body(engine, server, mux):
        engine.stray.append(pb.GenerateUpdate(stream_id=999, response=pb.GenerateResponse(
            tokens=[pb.GeneratedToken(token_id=9)])))
        engine.stray.append(pb.GenerateUpdate(stream_id=998, last=True, status_code=13))
        got = await read_all(mux.call(req(RUN, 3, base=10)))
        assert [t.token_id for r in got for t in r.tokens] == [10, 11, 12]
    run(body)


def test_break_fails_every_open_call_and_a_new_call_reconnects():
    """The engine's call breaks: every open request raises its status; the next call() opens a new
    GenerateStream call."""
    async def body(engine, server, mux):
        calls = [mux.call(req(HANG)) for _ in range(5)]
        for c in calls:
            await c.read()
        engine.break_status = (grpc.StatusCode.UNAVAILABLE, "engine draining")
        for c in calls:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.read()
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                           "engine draining")
            assert c.done() and not c.cancel()
        assert mux.open_requests() == 0
        engine.break_status = None
        got = await read_all(mux.call(req(RUN, 3)))
        assert len(got) == 3
        assert engine.opened == 2 and mux.opened == 2
    run(body)


def test_engine_restart():
    """The engine goes away (its server stops) with requests open: they fail; while it is away new
    calls fail UNAVAILABLE and nothing is opened meanwhile (no loop of reconnects); once it is back
    on the same address a new call is served."""
    async def main() -> None:
        engine = FakeEngine()
        server = await Server(engine).start()
        mux = GenerateStreamClient(server.target)
        s2: Optional[Server] = None
        try:
            calls = [mux.call(req(HANG)) for _ in range(3)]
            for c in calls:
                await c.read()
            await server.stop()
            for c in calls:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.read()
                assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mux.call(req(RUN, 2)).read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            opened = mux.opened
            await asyncio.sleep(0.5)
            assert mux.opened == opened  # nothing reopens by itself
            engine2 = FakeEngine()
            s2 = await Server(engine2, server.port).start()
            assert s2.port == server.port
            deadline = time.monotonic() + 10
            while True:
                try:
                    got = await read_all(mux.call(req(RUN, 2, base=5)))
                    break
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, err.details()
                    await asyncio.sleep(0.2)
            assert [t.token_id for r in got for t in r.tokens] == [5, 6]
            assert engine2.opened == 1
        finally:
            await mux.close()
            if s2 is not None:
                await s2.stop()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_close_ends_open_calls():
    async def body(engine, server, mux):
        call = mux.call(req(HANG))
        await call.read()
        await mux.close()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(RuntimeError):
            mux.call(req(RUN))
        for _ in range(100):
            if engine.open_calls == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.open_calls == 0  # the engine saw the call end
    run(body)


def test_shared_channel_left_open():
    async def main() -> None:
        engine = FakeEngine()
        server = await Server(engine).start()
        channel = grpc.aio.insecure_channel(server.target)
        try:
            async with GenerateStreamClient(channel) as mux:
                assert len(await read_all(mux.call(req(RUN, 2)))) == 2
            stub = pb_grpc.GeneratorStub(channel)
            assert (await stub.DescribeModel(pb.DescribeModelRequest())).model == "fake"
        finally:
            await channel.close()
            await server.stop()
    asyncio.run(asyncio.wait_for(main(), 30))
