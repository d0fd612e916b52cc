"""exl3-router serving DeepSeek-V4 (tests/fixtures/engine/deepseek_v4_all: sliding, compressed
sparse and heavily compressed attention, hyper-connections, a hash-routed first MoE layer):
greedy continuations equal transformers' (the fixture's greedy.i), with the experts in the
router's process and on two exl3-worker processes, whose hash-routed layer is routed by the
token ids the engine sends with each MoE call."""

import os
import sys
import unittest

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import FixtureGenerateTest, greedy_generate  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "engine", "deepseek_v4_all")


def greedy(stub, prompt, max_tokens):
    return greedy_generate(stub, prompt, max_tokens, pb)[0]


class GenerateDeepseekV4Test(FixtureGenerateTest):
    FIXTURE = FIXTURE

    def check(self, stub):
        for p, want in zip(self.prompts, self.greedy):
            self.assertEqual(greedy(stub, p, len(want)), want)

    def test_experts_in_process(self):
        r = self.c.start_router(with_map=False)
        with grpc.insecure_channel(r.address) as ch:
            self.check(pbg.GeneratorStub(ch))

    def test_experts_on_workers(self):
        self.c.start_workers(("a", "b"))
        r = self.c.start_router()
        with grpc.insecure_channel(r.address) as ch:
            stub = pbg.GeneratorStub(ch)
            self.wait_for_workers(stub, pb)
            self.check(stub)


if __name__ == "__main__":
    unittest.main()
