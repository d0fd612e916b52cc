"""exl3-router serving the families whose layers keep a recurrent state per sequence, each on its
engine fixture (tests/fixtures/engine/*_all): Qwen3-Next (gated DeltaNet, gated full attention),
GLM-5.3-Flash (KDA, NoPE MLA with the k-pooled indexer, hyper-connections) and Qwen3.8-Flash-Next
(Qwen4-Exp's text model: gated DeltaNet, a PLE n-gram layer, QSA attention, gated
hyper-connections). Concurrent greedy requests give transformers' continuations (the fixture's
greedy.i) with the experts in the router's process and on two exl3-worker processes; the router
says at start that prefix caching is off, and a repeated prompt is served without cached tokens
(and the same tokens)."""

import concurrent.futures
import os
import sys
import unittest

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import FixtureGenerateTest, greedy_generate  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "engine")


def greedy(stub, prompt, max_tokens):
    """(tokens, usage) of one greedy request."""
    return greedy_generate(stub, prompt, max_tokens, pb)


class RecurrentFamilyCases:
    """The cases of every recurrent family; a subclass names FIXTURE and ARCHITECTURE."""

    ARCHITECTURE = None  # config.json's architectures[0], as the router logs it

    def check_concurrent(self, stub):
        """Every prompt at once (their chunks and decode tokens share steps), twice over."""
        jobs = [(p, w) for p, w in zip(self.prompts, self.greedy)] * 2
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: greedy(stub, j[0], len(j[1]))[0], jobs))
        for i, ((_, want), tokens) in enumerate(zip(jobs, got)):
            self.assertEqual(tokens, want, f"request {i}")

    def test_experts_in_process(self):
        r = self.c.start_router(with_map=False)
        r.wait_for_log(rf"{self.ARCHITECTURE} keeps a recurrent state per sequence .*prefix caching "
                       r"is off")
        with grpc.insecure_channel(r.address) as ch:
            stub = pbg.GeneratorStub(ch)
            self.check_concurrent(stub)
            # The longest prompt twice: its full blocks would be a prefix-cache hit for a model
            # without recurrent layers.
            p, want = self.prompts[3], self.greedy[3]
            for _ in range(2):
                tokens, usage = greedy(stub, p, len(want))
                self.assertEqual(tokens, want)
                self.assertEqual(usage.cached_tokens, 0)

    def test_experts_on_workers(self):
        self.c.start_workers(("a", "b"))
        r = self.c.start_router()
        with grpc.insecure_channel(r.address) as ch:
            stub = pbg.GeneratorStub(ch)
            self.wait_for_workers(stub, pb)
            self.check_concurrent(stub)


class GenerateQwen3NextTest(RecurrentFamilyCases, FixtureGenerateTest):
    FIXTURE = os.path.join(FIXTURES, "qwen3_next_all")
    ARCHITECTURE = "Qwen3NextForCausalLM"


class GenerateGlm5NextTest(RecurrentFamilyCases, FixtureGenerateTest):
    FIXTURE = os.path.join(FIXTURES, "glm5_next_all")
    ARCHITECTURE = "Glm5NextForConditionalGeneration"


class GenerateQwen4ExpTest(RecurrentFamilyCases, FixtureGenerateTest):
    FIXTURE = os.path.join(FIXTURES, "qwen4_exp_all")
    ARCHITECTURE = "Qwen4ExpForConditionalGeneration"


if __name__ == "__main__":
    unittest.main()
