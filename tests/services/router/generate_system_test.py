"""The attention/router service end to end: exl3-router running a whole generated glm4_moe model
and serving Generator, with the experts in its own process and with the experts on exl3-worker
processes (a: experts 0-3 alone, b: 4-7, b2 a replica of b; two ping-pong micro-batches per step).
Greedy tokens agree between the two,
concurrent requests agree with requests alone, bad input gets its status, a cancelled call frees
its sequence, a replicated worker killed mid-generation costs nothing and the only holder of
experts killed fails the requests UNAVAILABLE without a hang."""

import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Cluster, make_test_model, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

PROMPTS = [[5, 9, 17, 33, 65], list(range(40, 71)), [3] * 12, [200, 100, 50, 25]]


def generate(stub, prompt, max_tokens=12, timeout=60, **sampling):
    """(tokens, finish_reason, usage, logprobs) of one greedy (by default) request."""
    sampling = {"temperature": 0, "logprobs": 0, **sampling}
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(**sampling))
    tokens, logprobs, finish, usage = [], [], None, None
    for r in stub.Generate(req, timeout=timeout):
        tokens += [t.token_id for t in r.tokens]
        logprobs += [t.logprob for t in r.tokens]
        if r.finish_reason:
            finish, usage = r.finish_reason, r.usage
    return tokens, finish, usage, logprobs


def scrape(metrics, name):
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class EngineDeviceTest(unittest.TestCase):
    """--engine-device: a name it does not know, or cuda where no GPU is (or the build has no
    CUDA backend), ends the router at start with a message saying why, never a hang."""

    FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "engine", "glm4_moe_all")

    def start(self, device):
        return subprocess.run([os.path.join(BIN, "exl3-router"), "--model", self.FIXTURE, "--listen",
                               "127.0.0.1:0", "--engine-device", device], capture_output=True, text=True,
                              timeout=60)

    def test_unknown_device(self):
        r = self.start("tpu")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("expected cpu or cuda", r.stderr)

    @unittest.skipIf(os.path.exists("/dev/nvidia0"), "a GPU is here: the CUDA engine would start")
    def test_cuda_without_a_gpu(self):
        r = self.start("cuda")
        self.assertNotEqual(r.returncode, 0)
        self.assertRegex(r.stderr, r"needs a GPU|no CUDA backend")


class GenerateSystemTest(unittest.TestCase):
    """Each case runs on a fresh cluster (setUp: a router holding the experts itself). The model
    (seconds of CPU to make) and the expected answers to PROMPTS are made once, the answers by
    a router of their own that is stopped before the first case."""

    @classmethod
    def setUpClass(cls):
        cls.model_dir = tempfile.mkdtemp(prefix="exl3-generate-model-")
        cls.model = os.path.join(cls.model_dir, "model")
        make_test_model(cls.model, whole_model=True)
        c = Cluster(model=cls.model)
        try:
            r = c.start_router(with_map=False)
            with grpc.insecure_channel(r.address) as ch:
                cls.expected = [generate(pbg.GeneratorStub(ch), p) for p in PROMPTS]
        finally:
            c.stop()

    def setUp(self):
        self.c = Cluster(model=self.model)
        self.addCleanup(self.c.stop)
        self.embedded = self.c.start_router(with_map=False)
        channel = grpc.insecure_channel(self.embedded.address)
        self.addCleanup(channel.close)
        self.stub = pbg.GeneratorStub(channel)

    def test_describe_and_usage(self):
        d = self.stub.DescribeModel(pb.DescribeModelRequest(), timeout=5)
        self.assertEqual(d.architecture, "Glm4MoeForCausalLM")
        self.assertEqual(d.experts, "local")
        self.assertEqual(d.vocab_size, 512)
        self.assertGreater(d.kv_capacity_tokens, 0)
        self.assertTrue(d.versions.server)  # the project version, not a literal
        tokens, finish, usage, _ = self.expected[1]
        self.assertEqual(len(tokens), 12)
        self.assertEqual(finish, pb.FINISH_REASON_LENGTH)
        self.assertEqual(usage.prompt_tokens, len(PROMPTS[1]))
        self.assertEqual(usage.completion_tokens, 12)

    def test_concurrent_requests_equal_requests_alone(self):
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda i: generate(self.stub, PROMPTS[i % len(PROMPTS)]), range(16)))
        for i, g in enumerate(got):
            self.assertEqual(g[0], self.expected[i % len(PROMPTS)][0], f"request {i}")

    def test_prefix_cache_hit_same_tokens(self):
        long_prompt = list(range(100, 140))  # 2 full blocks of 16 shared
        first = generate(self.stub, long_prompt)
        second = generate(self.stub, long_prompt)
        self.assertEqual(first[0], second[0])
        self.assertGreaterEqual(second[2].cached_tokens, 32)

    def test_seeded_sampling_repeats(self):
        a = generate(self.stub, PROMPTS[0], temperature=0.9, top_p=0.9, seed=7)
        b = generate(self.stub, PROMPTS[0], temperature=0.9, top_p=0.9, seed=7)
        self.assertEqual(a[0], b[0])

    def test_bad_input(self):
        cases = [
            (pb.GenerateRequest(prompt_token_ids=[], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[512], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[1], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[1], max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[1], max_tokens=4,
                                sampling=pb.SamplingParams(temperature=-1)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[1], max_tokens=4,
                                sampling=pb.SamplingParams(top_p=1.5)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt_token_ids=[1], max_tokens=4,
                                sampling=pb.SamplingParams(top_k=-2)),
             grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for req, code in cases:
            with self.assertRaises(grpc.RpcError) as e:
                list(self.stub.Generate(req, timeout=10))
            self.assertEqual(e.exception.code(), code, str(req))
        # The service goes on.
        self.assertEqual(generate(self.stub, PROMPTS[0])[0], self.expected[0][0])

    def test_cancel_frees_the_sequence(self):
        call = self.stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=3000,
                                                     ignore_eos=True), timeout=60)
        next(call)  # the first token has been sampled: the sequence runs
        call.cancel()
        wait_for(lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running") == 0, 10,
                 "the cancelled sequence to leave the engine")

    def test_deadline(self):
        with self.assertRaises(grpc.RpcError) as e:
            list(self.stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=3000,
                                                       ignore_eos=True, timeout_us=300000),
                                    timeout=30))
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_workers_give_the_same_tokens_and_survive_faults(self):
        # One case: the workers are started once, and the faults run last.
        self.c.start_workers(("a", "b", "b2"))
        # Two micro-batches: the MoE calls of one go out while the other's attention runs.
        r = self.c.start_router(extra=["--micro-batches", "2"])
        stub = pbg.GeneratorStub(grpc.insecure_channel(r.address))
        wait_for(lambda: stub.DescribeModel(pb.DescribeModelRequest(), timeout=2).experts ==
                 "workers" and generate(stub, [1], max_tokens=1), 30, "router with workers ready")
        for p, want in zip(PROMPTS, self.expected):
            tokens, _, _, logprobs = generate(stub, p)
            self.assertEqual(tokens, want[0])
            for a, b in zip(logprobs, want[3]):
                self.assertAlmostEqual(a, b, delta=1e-3)

        # b (replicated by b2) killed under load: every request completes with the same tokens.
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(generate, stub, PROMPTS[i % 4], 40) for i in range(8)]
            time.sleep(0.3)
            self.c.workers["b"].kill9()
            got = [f.result(timeout=120) for f in futs]
        self.assertTrue(all(len(g[0]) == 40 for g in got))

        # a (the only holder of experts 0-3) killed: requests fail UNAVAILABLE, none hangs.
        self.c.workers["a"].kill9()
        t0 = time.time()
        with self.assertRaises(grpc.RpcError) as e:
            generate(stub, PROMPTS[0], timeout=30)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertLess(time.time() - t0, 15)
        # Restarted, it serves again without a router restart.
        self.c.start_worker("a")
        wait_for(lambda: generate(stub, PROMPTS[0])[0] == self.expected[0][0], 30,
                 "generation after the worker's restart")


if __name__ == "__main__":
    unittest.main()
