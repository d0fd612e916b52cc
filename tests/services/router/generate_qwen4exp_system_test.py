"""exl3-router serving Qwen4-Exp (tests/fixtures/engine/qwen4_exp_all: Qwen4ExpForConditionalGeneration's
text model: gated DeltaNet layers with their per-sequence state, one with a PLE n-gram layer, a
QSA attention layer, gated hyper-connections, every layer MoE with the gated shared expert):
concurrent greedy requests give transformers' continuations (the fixture's greedy.i) with the
experts in the router's process and on two exl3-worker processes; the router says at start
that prefix caching is off."""

import concurrent.futures
import os
import sys
import unittest

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import FixtureGenerateTest, greedy_generate  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "engine", "qwen4_exp_all")


def greedy(stub, prompt, max_tokens):
    """(tokens, usage) of one greedy request."""
    return greedy_generate(stub, prompt, max_tokens, pb)


class GenerateQwen4ExpTest(FixtureGenerateTest):
    FIXTURE = FIXTURE

    def check_concurrent(self, stub):
        """Every prompt at once (their chunks and decode tokens share steps), twice over."""
        jobs = [(p, w) for p, w in zip(self.prompts, self.greedy)] * 2
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: greedy(stub, j[0], len(j[1]))[0], jobs))
        for i, ((_, want), tokens) in enumerate(zip(jobs, got)):
            self.assertEqual(tokens, want, f"request {i}")

    def test_experts_in_process(self):
        r = self.c.start_router(with_map=False)
        r.wait_for_log(r"Qwen4ExpForConditionalGeneration keeps a recurrent state per sequence .*"
                       r"prefix caching is off")
        with grpc.insecure_channel(r.address) as ch:
            stub = pbg.GeneratorStub(ch)
            self.check_concurrent(stub)

    def test_experts_on_workers(self):
        self.c.start_workers(("a", "b"))
        r = self.c.start_router()
        with grpc.insecure_channel(r.address) as ch:
            stub = pbg.GeneratorStub(ch)
            self.wait_for_workers(stub, pb)
            self.check_concurrent(stub)


if __name__ == "__main__":
    unittest.main()
