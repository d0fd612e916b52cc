"""Python clients of exl3serve and its OpenAI-compatible front end (package `exl3serve`, 0.1.0).

MoE router (exl3serve.v1.MoeRouter), taking and returning numpy arrays:

    from exl3serve_client import MoeRouterClient
    client = MoeRouterClient("127.0.0.1:50051")                 # or tls_ca=..., tls_cert=..., tls_key=...
    info = client.describe()                                    # RouterDescribeResponse
    y = client.forward(layer=3, hidden=x)                       # x: [T, hidden] float32/float16 array
    with client.stream() as s:                                  # many requests in flight on one stream
        futs = [s.submit(layer, x) for layer in info.model.moe_layers]
        ys = [f.result() for f in futs]

Errors of a single request raise RequestError (with .code, a grpc.StatusCode, and .message); the
stream and the other requests go on.

Generator (exl3serve.v1.Generator, token ids): GenerateClient and AsyncGenerateClient
(exl3serve_client/generate.py); GenerateStreamClient puts many requests on one GenerateStream call
(exl3serve_client/generate_stream.py). The OpenAI-compatible HTTP front end is exl3serve_client.frontend
(console script `exl3serve-openai`); `exl3serve-make-tokenizer` gives a test model a tokenizer.
The gRPC stubs ship in the package as `exl3serve.v1`.
"""

__version__ = "0.1.0"

from .client import LayerResult, MoeRouterClient, MoeStream, RequestError  # noqa: F401
from .generate import (AsyncGenerateClient, GenerateClient, GenerateResult,  # noqa: F401
                       make_generate_request)
from .generate_stream import GenerateStreamClient, StreamedCall  # noqa: F401
