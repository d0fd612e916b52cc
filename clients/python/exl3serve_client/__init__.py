"""Python client of the exl3serve MoE router (exl3serve.v1.MoeRouter), taking and returning numpy arrays.

    from exl3serve_client import MoeRouterClient
    client = MoeRouterClient("127.0.0.1:50051")                 # or tls_ca=..., tls_cert=..., tls_key=...
    info = client.describe()                                    # RouterDescribeResponse
    y = client.forward(layer=3, hidden=x)                       # x: [T, hidden] float32/float16 array
    with client.stream() as s:                                  # many requests in flight on one stream
        futs = [s.submit(layer, x) for layer in info.model.moe_layers]
        ys = [f.result() for f in futs]

Errors of a single request raise RequestError (with .code, a grpc.StatusCode, and .message); the
stream and the other requests go on. The stubs come from clients/python/generate_stubs.sh.
"""

from .client import MoeRouterClient, MoeStream, RequestError, LayerResult  # noqa: F401
