"""Generate traffic for the live stack (scripts/checks/deploy/live_stack.py): `--requests` greedy
Generate calls over `--concurrency` streams against exl3-router's Generator, so the engine's
metrics carry data when the dashboards' queries run. Runs with Debian's python3-grpcio and the
stubs the build generates (PYTHONPATH=BUILD/python). Exits non-zero if any call fails."""

import argparse
import concurrent.futures
import sys

import grpc

from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve.v1 import exl3serve_pb2_grpc as pbg


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    stub = pbg.GeneratorStub(grpc.insecure_channel(a.target))

    def one(i):
        req = pb.GenerateRequest(prompt_token_ids=[(7 * i + j) % 200 + 1 for j in range(20)],
                                 max_tokens=16, ignore_eos=True,
                                 sampling=pb.SamplingParams(temperature=0))
        return sum(len(r.tokens) for r in stub.Generate(req, timeout=60))

    with concurrent.futures.ThreadPoolExecutor(a.concurrency) as ex:
        tokens = list(ex.map(one, range(a.requests)))
    print(f"generate: requests={len(tokens)} tokens={sum(tokens)}")
    return 0 if all(t == 16 for t in tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
