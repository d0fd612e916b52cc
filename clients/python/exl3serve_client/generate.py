"""Clients of the Generator service (proto/exl3serve/v1/exl3serve.proto): token ids in, token ids out.

    from exl3serve_client import GenerateClient, AsyncGenerateClient
    with GenerateClient("127.0.0.1:50051") as c:
        r = c.generate([1, 2, 3], max_tokens=16, temperature=0)      # GenerateResult
        for resp in c.stream([1, 2, 3], max_tokens=16):              # GenerateResponse messages
            ...
    async with AsyncGenerateClient("127.0.0.1:50051") as c:
        r = await c.generate([1, 2, 3], max_tokens=16)
        async for resp in c.stream([1, 2, 3], max_tokens=16):
            ...

A refused or failed request raises RequestError (.code is a grpc.StatusCode). Leaving a stream's
loop early (break, an exception, task cancellation) cancels the call, which frees the sequence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Iterator, Optional, Sequence

import grpc
import grpc.aio

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc

from .client import RequestError, open_channel

# Reconnect quickly after an engine restart: the default backoff grows to two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10000),
)

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


def make_generate_request(prompt_token_ids: Sequence[int], *, max_tokens: int,
                          temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                          min_p: float = 0.0, repetition_penalty: float = 0.0,
                          presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                          seed: Optional[int] = None, logprobs: int = 0, min_tokens: int = 0,
                          stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                          timeout_us: int = 0, request_id: str = "",
                          prompt_logprobs: Optional[int] = None) -> pb.GenerateRequest:
    """A GenerateRequest; the defaults are the proto's (greedy, no filters, no penalties, no
    prompt logprobs)."""
    sampling = pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                 repetition_penalty=repetition_penalty,
                                 presence_penalty=presence_penalty,
                                 frequency_penalty=frequency_penalty, logprobs=logprobs)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex,
                             prompt_token_ids=list(prompt_token_ids), sampling=sampling,
                             max_tokens=max_tokens, min_tokens=min_tokens,
                             stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                             timeout_us=timeout_us)
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    return req


@dataclass
class GenerateResult:
    """A whole request's output, gathered from its stream."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With prompt_logprobs: prompt tokens 1.. as (token id, logprob, rank, top [(id, logprob)]).
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    usage: Optional[pb.Usage] = None
    timings: Optional[pb.GenerateTimings] = None

    def add(self, resp: pb.GenerateResponse) -> None:
        for p in resp.prompt_logprobs:
            self.prompt_logprobs.append((p.token_id, p.logprob, p.rank,
                                         [(e.token_id, e.logprob) for e in p.top_logprobs]))
        for t in resp.tokens:
            self.token_ids.append(t.token_id)
            self.logprobs.append(t.logprob)
            self.top_logprobs.append([(e.token_id, e.logprob) for e in t.top_logprobs])
        if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(resp.finish_reason, "error")
            self.usage = resp.usage
            self.timings = resp.timings


def request_error(e: grpc.RpcError) -> RequestError:
    """The RequestError of a failed call (sync or asyncio)."""
    return RequestError(e.code(), e.details() or "")


def _request(prompt_token_ids, kw) -> pb.GenerateRequest:
    if isinstance(prompt_token_ids, pb.GenerateRequest):
        return prompt_token_ids
    return make_generate_request(prompt_token_ids, **kw)


class GenerateClient:
    """Blocking client of exl3serve.v1.Generator. TLS as MoeRouterClient (tls_ca, tls_cert, tls_key)."""

    def __init__(self, target: str, **channel_kw) -> None:
        self._channel = open_channel(grpc, target, options=CHANNEL_OPTIONS, **channel_kw)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def describe(self, timeout: float = 5.0) -> pb.DescribeModelResponse:
        try:
            return self._stub.DescribeModel(pb.DescribeModelRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise request_error(e) from None

    def engine_stats(self, timeout: float = 5.0) -> pb.EngineStatsResponse:
        """The engine's running/waiting requests, KV usage and totals now (Generator.EngineStats)."""
        try:
            return self._stub.EngineStats(pb.EngineStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise request_error(e) from None

    def stream(self, prompt_token_ids, *, timeout: Optional[float] = None,
               **kw) -> Iterator[pb.GenerateResponse]:
        """The response messages of one request (a GenerateRequest or prompt ids + make_generate_request's
        keywords); closing the iterator early cancels the call."""
        call = self._stub.Generate(_request(prompt_token_ids, kw), timeout=timeout)
        try:
            for resp in call:
                yield resp
        except grpc.RpcError as e:
            raise request_error(e) from None
        finally:
            call.cancel()

    def generate(self, prompt_token_ids, *, timeout: Optional[float] = None, **kw) -> GenerateResult:
        result = GenerateResult()
        for resp in self.stream(prompt_token_ids, timeout=timeout, **kw):
            result.add(resp)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerateClient:
    """asyncio client of exl3serve.v1.Generator (grpc.aio); create it inside the running loop."""

    def __init__(self, target: str, **channel_kw) -> None:
        self._channel = open_channel(grpc.aio, target, options=CHANNEL_OPTIONS, **channel_kw)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    @property
    def channel(self) -> grpc.aio.Channel:
        """The client's channel (a GenerateStreamClient can share it)."""
        return self._channel

    async def wait_ready(self, timeout: float = 10.0) -> None:
        import asyncio
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def describe(self, timeout: float = 5.0) -> pb.DescribeModelResponse:
        try:
            return await self._stub.DescribeModel(pb.DescribeModelRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise request_error(e) from None

    async def engine_stats(self, timeout: float = 5.0) -> pb.EngineStatsResponse:
        """The engine's running/waiting requests, KV usage and totals now (Generator.EngineStats)."""
        try:
            return await self._stub.EngineStats(pb.EngineStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise request_error(e) from None

    def call(self, request: pb.GenerateRequest, timeout: Optional[float] = None) -> grpc.aio.UnaryStreamCall:
        """The raw call of one request (read() each message, cancel() to free the sequence)."""
        return self._stub.Generate(request, timeout=timeout)

    async def stream(self, prompt_token_ids, *, timeout: Optional[float] = None,
                     **kw) -> AsyncIterator[pb.GenerateResponse]:
        """As GenerateClient.stream; the call is cancelled when the generator is closed or its task
        cancelled."""
        call = self.call(_request(prompt_token_ids, kw), timeout=timeout)
        try:
            async for resp in call:
                yield resp
        except grpc.RpcError as e:
            raise request_error(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt_token_ids, *, timeout: Optional[float] = None,
                       **kw) -> GenerateResult:
        result = GenerateResult()
        async for resp in self.stream(prompt_token_ids, timeout=timeout, **kw):
            result.add(resp)
        return result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncGenerateClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
