"""Thin numpy wrapper over the generated exl3serve.v1 stubs."""

import itertools
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import numpy as np

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc

_NP_OF = {pb.DTYPE_FP32: np.dtype("<f4"), pb.DTYPE_FP16: np.dtype("<f2")}
_CODE_OF = {c.value[0]: c for c in grpc.StatusCode}


def open_channel(module, target, *, tls_ca=None, tls_cert=None, tls_key=None,
                 server_name_override=None, max_message_bytes=64 << 20, options=()):
    """A channel of `module` (grpc or grpc.aio) to target: TLS when tls_ca or tls_cert is given,
    mutual TLS with tls_cert + tls_key; `options` are added to the message-size limits."""
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes), *options]
    if not (tls_ca or tls_cert):
        return module.insecure_channel(target, options=opts)

    def read(path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()
    creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
    if server_name_override:
        opts.append(("grpc.ssl_target_name_override", server_name_override))
    return module.secure_channel(target, creds, options=opts)


class RequestError(Exception):
    """One request failed; `code` is a grpc.StatusCode, `message` the server's explanation."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class LayerResult:
    output: np.ndarray      # [T, hidden] float32 (or float16 when asked)
    topk_ids: np.ndarray    # [T, k] int32: the experts used
    topk_weights: np.ndarray  # [T, k] float32
    timings: object         # RouterTimings


def _to_tensor(a, dtype):
    """numpy array -> pb.Tensor. dtype: 'fp32', 'fp16' or 'bf16' (bf16 rounds to nearest even)."""
    a = np.asarray(a)
    t = pb.Tensor(shape=list(a.shape))
    if dtype == "fp32":
        t.dtype = pb.DTYPE_FP32
        t.data = np.ascontiguousarray(a, dtype="<f4").tobytes()
    elif dtype == "fp16":
        t.dtype = pb.DTYPE_FP16
        t.data = np.ascontiguousarray(a, dtype="<f2").tobytes()
    elif dtype == "bf16":
        t.dtype = pb.DTYPE_BF16
        u = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        t.data = u.astype("<u2").tobytes()
    else:
        raise ValueError(f"dtype must be fp32, fp16 or bf16, not {dtype!r}")
    return t


def _from_tensor(t):
    shape = tuple(t.shape)
    if t.dtype == pb.DTYPE_BF16:
        u = np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16
        return u.view("<f4").reshape(shape)
    if t.dtype not in _NP_OF:
        raise ValueError(f"unknown tensor dtype {t.dtype}")
    return np.frombuffer(t.data, dtype=_NP_OF[t.dtype]).reshape(shape)


_OUT = {"fp32": pb.DTYPE_FP32, "fp16": pb.DTYPE_FP16, "bf16": pb.DTYPE_BF16}


def make_request(layer, hidden, *, dtype=None, output_dtype="fp32", include_shared_expert=True,
                 router_logits=None, topk_ids=None, topk_weights=None, token_ids=None,
                 timeout_ms=0):
    """Builds a MoeLayerRequest. `dtype` defaults to the array's (float16 -> fp16, else fp32)."""
    hidden = np.asarray(hidden)
    if dtype is None:
        dtype = "fp16" if hidden.dtype == np.float16 else "fp32"
    req = pb.MoeLayerRequest(layer=layer, hidden=_to_tensor(hidden, dtype),
                             output_dtype=_OUT[output_dtype],
                             include_shared_expert=include_shared_expert,
                             timeout_us=int(timeout_ms * 1000))
    if router_logits is not None:
        req.router_logits.CopyFrom(_to_tensor(router_logits, "fp32"))
    if topk_ids is not None:
        ids = np.asarray(topk_ids, dtype=np.int32)
        req.topk.k = ids.shape[1]
        req.topk.ids.extend(ids.ravel().tolist())
        req.topk.weights.extend(np.asarray(topk_weights, dtype=np.float32).ravel().tolist())
    if token_ids is not None:
        req.token_ids.extend(np.asarray(token_ids, dtype=np.int64).ravel().tolist())
    return req


def _result(resp):
    if resp.status.code != pb.OK:
        raise RequestError(_CODE_OF.get(resp.status.code, grpc.StatusCode.UNKNOWN),
                           resp.status.message)
    k = resp.topk.k or 1
    return LayerResult(output=_from_tensor(resp.output),
                       topk_ids=np.asarray(resp.topk.ids, dtype=np.int32).reshape(-1, k),
                       topk_weights=np.asarray(resp.topk.weights, dtype=np.float32).reshape(-1, k),
                       timings=resp.timings)


class MoeStream:
    """One MoeRouter.Forward stream with many requests in flight, answered in any order."""

    def __init__(self, stub, metadata=None):
        self._ids = itertools.count(1)
        self._pending = {}
        self._lock = threading.Lock()
        self._outbox = queue.Queue()
        self._closed = False
        self._call = stub.Forward(iter(self._outbox.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        err = None
        try:
            for resp in self._call:
                with self._lock:
                    fut = self._pending.pop(resp.id, None)
                if fut is not None:
                    fut.set_result(resp)
        except grpc.RpcError as e:  # the stream ended with an error
            err = RequestError(e.code(), e.details() or "stream failed")
        with self._lock:
            left, self._pending = self._pending, {}
            self._closed = True
        for fut in left.values():
            fut.set_exception(err or RequestError(grpc.StatusCode.UNAVAILABLE,
                                                  "stream ended before the answer"))

    def submit_request(self, req):
        """Sends a prepared MoeLayerRequest (its id is assigned); returns a Future of the raw response."""
        fut = Future()
        with self._lock:
            if self._closed:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "stream closed")
            req.id = next(self._ids)
            self._pending[req.id] = fut
        self._outbox.put(req)
        return fut

    def submit(self, layer, hidden, **kw):
        """Sends one layer request; returns a Future of a LayerResult (raises RequestError)."""
        raw = self.submit_request(make_request(layer, hidden, **kw))
        out = Future()

        def done(f):
            try:
                out.set_result(_result(f.result()))
            except Exception as e:  # noqa: BLE001 - forwarded to the caller
                out.set_exception(e)
        raw.add_done_callback(done)
        return out

    def close(self):
        """Half-closes after the requests sent so far and waits for their answers."""
        self._outbox.put(None)
        self._reader.join()

    def cancel(self):
        """Cancels the whole stream."""
        self._call.cancel()

    def cancel_request(self, req_id, reason=pb.CANCEL_REASON_CLIENT):
        """Withdraws one request (`req_id`: the id submit_request gave it): the router answers it
        CANCELLED and withdraws its work from the workers, unless it was answered already."""
        self._outbox.put(pb.MoeLayerRequest(id=req_id, cancel=pb.Cancel(reason=reason)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MoeRouterClient:
    """Connection to an exl3-router. TLS when tls_ca is given; mutual TLS with tls_cert + tls_key."""

    def __init__(self, target, *, tls_ca=None, tls_cert=None, tls_key=None,
                 server_name_override=None, max_message_bytes=64 << 20):
        self._channel = open_channel(grpc, target, tls_ca=tls_ca, tls_cert=tls_cert,
                                     tls_key=tls_key, server_name_override=server_name_override,
                                     max_message_bytes=max_message_bytes)
        self._stub = pb_grpc.MoeRouterStub(self._channel)

    def wait_ready(self, timeout=10.0):
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def describe(self, timeout=5.0):
        return self._stub.Describe(pb.RouterDescribeRequest(), timeout=timeout)

    def stream(self):
        return MoeStream(self._stub)

    def forward(self, layer, hidden, **kw):
        """One layer on a short-lived stream; returns the output [T, hidden] as a numpy array."""
        return self.forward_full(layer, hidden, **kw).output

    def forward_full(self, layer, hidden, **kw):
        """Like forward, returning a LayerResult (output, routing used, timings)."""
        with self.stream() as s:
            return s.submit(layer, hidden, **kw).result()

    def close(self):
        self._channel.close()
