"""The attention/router service end to end: exl3-router running a whole generated glm4_moe model
and serving Generator, with the experts in its own process and with the experts on exl3-worker
processes (a: experts 0-3 alone, b: 4-7, b2 a replica of b; two ping-pong micro-batches per step).
Greedy tokens agree between the two,
concurrent requests agree with requests alone, bad input gets its status, a cancelled call frees
its sequence, a replicated worker killed mid-generation costs nothing and the only holder of
experts killed fails the requests UNAVAILABLE without a hang."""

import concurrent.futures
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Cluster, make_test_model, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

PROMPTS = [[5, 9, 17, 33, 65], list(range(40, 71)), [3] * 12, [200, 100, 50, 25]]


def generate(stub, prompt, max_tokens=12, timeout=60, stop_token_ids=(), min_tokens=0,
             **sampling):
    """(tokens, finish_reason, usage, logprobs) of one greedy (by default) request."""
    sampling = {"temperature": 0, "logprobs": 0, **sampling}
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             stop_token_ids=list(stop_token_ids), min_tokens=min_tokens,
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


class StreamCall:
    """One Generator.GenerateStream call: requests sent from a queue, every message and update
    read on a thread of its own."""

    def __init__(self, stub, timeout=60):
        self._out = queue.Queue()
        self.messages = []  # GenerateStreamResponse, in order
        self.status = None  # the call's final grpc.StatusCode once it ended
        self._cv = threading.Condition()

        def requests():
            while (m := self._out.get()) is not None:
                yield m

        self._call = stub.GenerateStream(requests(), timeout=timeout)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        try:
            for m in self._call:
                with self._cv:
                    self.messages.append(m)
                    self._cv.notify_all()
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        with self._cv:
            self.status = code
            self._cv.notify_all()

    def start(self, stream_id, **req):
        self.send(pb.GenerateAction(stream_id=stream_id, start=pb.GenerateRequest(**req)))

    def cancel(self, stream_id):
        self.send(pb.GenerateAction(stream_id=stream_id, cancel=pb.CancelGenerate()))

    def send(self, *actions):
        self._out.put(pb.GenerateStreamRequest(actions=list(actions)))

    def half_close(self):
        self._out.put(None)

    def cancel_call(self):
        self._call.cancel()

    def updates(self, stream_id):
        with self._cv:
            return [u for m in self.messages for u in m.updates if u.stream_id == stream_id]

    def wait(self, pred, timeout=30, what="the call"):
        with self._cv:
            if not self._cv.wait_for(lambda: pred(self), timeout):
                raise AssertionError(f"timed out waiting for {what}")

    def last(self, stream_id, timeout=30):
        """The request's last update, once it has come."""
        self.wait(lambda c: any(u.last for u in c.updates(stream_id)), timeout,
                  f"the last update of request {stream_id}")
        return [u for u in self.updates(stream_id) if u.last][0]

    def tokens(self, stream_id):
        return [t.token_id for u in self.updates(stream_id) for t in u.response.tokens]


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
        self.assertEqual(d.max_context, 4096)  # the model's max_position_embeddings
        self.assertEqual(d.kv_capacity_tokens, 16384)  # --kv-cache-tokens' default
        self.assertEqual(d.kv_block_size, 16)
        self.assertTrue(d.versions.server)  # the project version, not a literal
        tokens, finish, usage, _ = self.expected[1]
        self.assertEqual(len(tokens), 12)
        self.assertEqual(finish, pb.FINISH_REASON_LENGTH)
        self.assertEqual(usage.prompt_tokens, len(PROMPTS[1]))
        self.assertEqual(usage.completion_tokens, 12)
        self.assertEqual(d.model, "model")  # the model directory's name (no --served-model-name)
        self.assertEqual(d.eos_token_ids, [1])
        self.assertGreater(d.max_num_seqs, 0)

    def test_timings_on_the_last_message(self):
        """The last message carries the request's timings: queue + prefill is the time to the
        first token, within the whole; the mean inter-token time is that of 12 tokens; earlier
        messages carry none."""
        req = pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=12, ignore_eos=True,
                                 sampling=pb.SamplingParams(temperature=0))
        t0 = time.monotonic()
        msgs = list(self.stub.Generate(req, timeout=60))
        wall = time.monotonic() - t0
        for m in msgs[:-1]:
            self.assertFalse(m.HasField("timings"))
            self.assertFalse(m.HasField("usage"))
        t = msgs[-1].timings
        self.assertGreaterEqual(t.queue_seconds, 0)
        self.assertGreater(t.prefill_seconds, 0)
        self.assertAlmostEqual(t.queue_seconds + t.prefill_seconds, t.first_token_seconds,
                               delta=1e-6)
        self.assertGreater(t.mean_inter_token_seconds, 0)
        self.assertLessEqual(t.first_token_seconds + 11 * t.mean_inter_token_seconds,
                             t.total_seconds + 1e-6)
        self.assertLessEqual(t.total_seconds, wall)

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
        """Every refused field: INVALID_ARGUMENT naming it, at once, alone."""
        def req(prompt=(1,), max_tokens=4, **kw):
            sampling = kw.pop("sampling", {})
            return pb.GenerateRequest(prompt_token_ids=list(prompt), max_tokens=max_tokens,
                                      sampling=pb.SamplingParams(**sampling), **kw)
        cases = [
            (req(prompt=()), "empty"),
            (req(prompt=(512,)), "vocabulary"),
            (req(prompt=(-1,)), "vocabulary"),
            (req(prompt=[1] * 4096), "context"),  # a prompt as long as the context
            (req(max_tokens=0), "max_tokens"),
            (req(max_tokens=-1), "max_tokens"),
            (req(max_tokens=5000), "context"),
            (req(max_tokens=4, min_tokens=5), "min_tokens"),
            (req(stop_token_ids=[512]), "stop_token_ids"),
            (req(sampling={"temperature": -1}), "temperature"),
            (req(sampling={"temperature": float("nan")}), "temperature"),
            (req(sampling={"top_p": 1.5}), "top_p"),
            (req(sampling={"top_p": -0.5}), "top_p"),
            (req(sampling={"top_k": -2}), "top_k"),
            (req(sampling={"min_p": -0.1}), "min_p"),
            (req(sampling={"min_p": 1.5}), "min_p"),
            (req(sampling={"repetition_penalty": -1}), "repetition_penalty"),
            (req(sampling={"logprobs": -1}), "logprobs"),
            (req(sampling={"logprobs": 513}), "logprobs"),
        ]
        for r, word in cases:
            t0 = time.monotonic()
            with self.assertRaises(grpc.RpcError) as e:
                list(self.stub.Generate(r, timeout=10))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, str(r)[:200])
            self.assertIn(word, e.exception.details(), str(r)[:200])
            self.assertLess(time.monotonic() - t0, 2)
        # The service goes on.
        self.assertEqual(generate(self.stub, PROMPTS[0])[0], self.expected[0][0])

    def test_stop_tokens_min_tokens_and_top_logprobs(self):
        """stop_token_ids end a request at the first such token (returned, finish STOP); min_tokens
        holds them back until that many tokens; logprobs=N gives the top N, best first, the
        chosen (greedy) token's among them."""
        free = self.expected[0][0]  # 12 greedy tokens
        stop = free[3]
        first = free.index(stop)
        tokens, finish, usage, _ = generate(self.stub, PROMPTS[0], stop_token_ids=[stop])
        self.assertEqual(tokens, free[:first + 1])
        self.assertEqual(finish, pb.FINISH_REASON_STOP)
        self.assertEqual(usage.completion_tokens, first + 1)
        tokens, finish, _, _ = generate(self.stub, PROMPTS[0], stop_token_ids=[stop],
                                        min_tokens=12)
        self.assertEqual(len(tokens), 12)
        self.assertNotIn(stop, tokens)
        self.assertEqual(finish, pb.FINISH_REASON_LENGTH)

        req = pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=6, ignore_eos=True,
                                 sampling=pb.SamplingParams(temperature=0, logprobs=5))
        got = [t for r in self.stub.Generate(req, timeout=60) for t in r.tokens]
        self.assertEqual([t.token_id for t in got], self.expected[1][0][:6])
        for t in got:
            self.assertEqual(len(t.top_logprobs), 5)
            lps = [e.logprob for e in t.top_logprobs]
            self.assertEqual(lps, sorted(lps, reverse=True))
            self.assertEqual(t.top_logprobs[0].token_id, t.token_id)
            self.assertAlmostEqual(t.top_logprobs[0].logprob, t.logprob, places=5)
            self.assertLessEqual(t.logprob, 0.0)
            self.assertLess(sum(math.exp(x) for x in lps), 1.0 + 1e-5)

    def test_cancel_frees_the_sequence(self):
        """A cancelled call (and one whose client closes its channel) leaves the engine and gives
        back its KV blocks at once (the KV usage metric returns to 0)."""
        kv = lambda: scrape(self.embedded.metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
        running = lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running")  # noqa: E731
        long = pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        call = self.stub.Generate(long, timeout=60)
        next(call)  # the first token has been sampled: the sequence runs
        wait_for(lambda: kv() > 0, 5, "the sequence's blocks in the KV usage metric")
        t0 = time.monotonic()
        call.cancel()
        wait_for(lambda: running() == 0 and kv() == 0, 10,
                 "the cancelled sequence to leave the engine and free its blocks")
        self.assertLess(time.monotonic() - t0, 2)
        # A client whose channel goes away without a cancel.
        channel = grpc.insecure_channel(self.embedded.address)
        call = pbg.GeneratorStub(channel).Generate(long, timeout=60)
        next(call)
        wait_for(lambda: kv() > 0, 5, "the second sequence's blocks")
        channel.close()
        wait_for(lambda: running() == 0 and kv() == 0, 10,
                 "the closed channel's sequence to leave the engine and free its blocks")

    def test_engine_stats(self):
        """Generator.EngineStats answers the engine's state: a running sequence and its KV blocks
        while it runs, nothing after; its totals equal the engine's own metrics (prefix cache);
        no speculative counters without a speculative method."""
        stats = lambda: self.stub.EngineStats(pb.EngineStatsRequest(), timeout=5)  # noqa: E731
        idle = stats()
        self.assertEqual((idle.num_requests_running, idle.num_requests_waiting), (0, 0))
        self.assertEqual(idle.kv_cache_usage, 0)
        long = pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        call = self.stub.Generate(long, timeout=60)
        next(call)  # the sequence runs
        wait_for(lambda: stats().num_requests_running == 1, 5, "EngineStats: one running")
        busy = stats()
        self.assertGreater(busy.kv_cache_usage, 0)
        self.assertLessEqual(busy.kv_cache_usage, 1)
        call.cancel()
        wait_for(lambda: stats().num_requests_running == 0 and stats().kv_cache_usage == 0, 10,
                 "EngineStats: the cancelled sequence gone")
        for _ in range(2):  # the same prompt twice: the second is found in the prefix cache
            generate(self.stub, PROMPTS[1], max_tokens=1)
        wait_for(lambda: stats().prefix_cache_queried_tokens ==
                 scrape(self.embedded.metrics, "exl3_engine_prefix_cache_queries_total") and
                 stats().prefix_cache_hit_tokens ==
                 scrape(self.embedded.metrics, "exl3_engine_prefix_cache_hits_total"), 5,
                 "EngineStats' prefix cache totals equal the engine's metrics")
        s = stats()
        self.assertGreater(s.prefix_cache_hit_tokens, 0)
        self.assertEqual(s.num_preemptions,
                         scrape(self.embedded.metrics, "exl3_engine_num_preemptions_total"))
        self.assertEqual(s.num_speculative_tokens, 0)
        self.assertEqual(list(s.spec_decode_num_accepted_tokens_per_pos), [])

    def test_kv_capacity_and_request_limit(self):
        """A prompt beyond the whole KV cache is INVALID_ARGUMENT; more unfinished requests than
        --max-pending-requests is RESOURCE_EXHAUSTED, at once, and the held requests go on."""
        r = self.c.start_router(with_map=False, extra=["--kv-cache-tokens", "64",
                                                        "--max-pending-requests", "2"])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)
        with self.assertRaises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[7] * 65, max_tokens=1),
                               timeout=10))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("context of 64 tokens (the whole KV cache", e.exception.details())
        # Issue 28: the context reported is the cache's, and what can never fit it is refused up
        # front (it was accepted and failed RESOURCE_EXHAUSTED once the cache was full).
        self.assertEqual(pbg.GeneratorStub(channel).DescribeModel(pb.DescribeModelRequest(),
                                                                  timeout=10).max_context, 64)
        with self.assertRaises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[7] * 10, max_tokens=55,
                                                  ignore_eos=True), timeout=10))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("exceeds the context of 64 tokens", e.exception.details())
        # The request limit, on a router whose cache lets the two held requests run long (in the
        # 64-token cache above they could finish before the third was sent on a loaded machine).
        r = self.c.start_router(with_map=False, extra=["--max-pending-requests", "2"])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)
        held = [stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=500,
                                                 ignore_eos=True), timeout=120) for _ in range(2)]
        # Both accepted and running (a first message may carry more than one token).
        first = [len(next(call).tokens) for call in held]
        t0 = time.monotonic()
        with self.assertRaises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], max_tokens=2), timeout=10))
        self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("max_pending_requests", e.exception.details())
        self.assertLess(time.monotonic() - t0, 2)
        for call, n in zip(held, first):
            self.assertEqual(n + sum(len(m.tokens) for m in call), 500)

    def test_drain_cut_short_ends_requests_unavailable(self):
        """Issue 28: a drain cut short by --drain-grace-ms ends the requests still running
        UNAVAILABLE "server draining" (not CANCELLED, which reads as the client's own), logs how
        many it cut, and the router exits non-zero."""
        r = self.c.start_router(with_map=False, extra=["--drain-grace-ms", "100"])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)
        context = stub.DescribeModel(pb.DescribeModelRequest(), timeout=10).max_context
        calls = [stub.Generate(pb.GenerateRequest(prompt_token_ids=p, max_tokens=context - len(p),
                                                  ignore_eos=True), timeout=60)
                 for p in PROMPTS[:2]]
        for call in calls:
            next(call)  # running
        r.signal(signal.SIGTERM)
        for call in calls:
            with self.assertRaises(grpc.RpcError) as e:
                for _ in call:
                    pass
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            self.assertIn("server draining", e.exception.details())
        self.assertEqual(r.p.wait(timeout=30), 1)
        self.assertIn("drain cut short: 2 generation requests ended UNAVAILABLE", r.text())

    def test_truncated_model_file_under_a_running_router(self):
        """Issue 28: the router died with SIGBUS, logging nothing, when one of its model files was
        truncated under it. Its weights now live in memory it owns: it logs the change and
        serves the same tokens from the copy made at load."""
        model = os.path.join(self.c.dir, "own-model")
        shutil.copytree(self.model, model)
        self.c.model = model
        r = self.c.start_router(with_map=False)
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)
        before = generate(stub, PROMPTS[1])[0]
        for name in os.listdir(model):
            if name.endswith(".safetensors"):
                with open(os.path.join(model, name), "r+b") as f:
                    f.truncate(4096)
        r.wait_for_log(r"model file \S+\.safetensors changed after the load: size \d+ -> 4096 bytes; "
                       r"serving on from the copy")
        for prompt in PROMPTS:
            self.assertEqual(generate(stub, prompt)[0], self.expected[PROMPTS.index(prompt)][0])
        self.assertEqual(generate(stub, PROMPTS[1])[0], before)
        self.assertTrue(r.alive())

    def test_token_budget_and_long_prefill_threshold(self):
        """--max-num-batched-tokens caps the tokens of every step and --long-prefill-token-threshold
        each prompt's chunk (exl3_engine_step_tokens); the tokens are those of a router without
        either."""
        r = self.c.start_router(with_map=False, extra=["--max-num-batched-tokens", "6",
                                                        "--long-prefill-token-threshold", "4"])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)

        def buckets():
            """exl3_engine_step_tokens' cumulative bucket counts by upper bound (math.inf: every
            step), from one scrape, so that the buckets compared are of the same steps."""
            text = urllib.request.urlopen(f"http://{r.metrics}/metrics", timeout=5).read().decode()
            return {float(le): float(v) for le, v in
                    re.findall(r'^exl3_engine_step_tokens_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}

        # Alone: the 31-token prompt in chunks of at most 4 (8 steps), then 11 decode steps. The
        # last step's observation may land after the response: wait for it.
        self.assertEqual(generate(stub, PROMPTS[1])[0], self.expected[1][0])
        b = wait_for(lambda: (lambda b: b if b[math.inf] >= 8 + 11 else None)(buckets()), 5,
                     "the lone request's steps in exl3_engine_step_tokens")
        self.assertEqual(b[4], b[math.inf])
        # Together: decode tokens and prompt chunks share each step's 6 tokens.
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda p: generate(stub, p), PROMPTS))
        for g, want in zip(got, self.expected):
            self.assertEqual(g[0], want[0])
        b = buckets()
        self.assertEqual(b[8], b[math.inf])
        self.assertGreater(b[math.inf], b[4])  # some steps carried 5 or 6 tokens

    def test_moe_stages_in_process(self):
        """With the experts in process the MoE phase of each step is split into its stages: the
        gate and the experts, together within the phase's own time."""
        def sums():
            text = urllib.request.urlopen(f"http://{self.embedded.metrics}/metrics",
                                          timeout=5).read().decode()

            def get(series):
                return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.M).group(1))
            return (get('exl3_engine_moe_stage_seconds_sum{stage="gate"}'),
                    get('exl3_engine_moe_stage_seconds_sum{stage="experts"}'),
                    get('exl3_engine_moe_stage_seconds_count{stage="gate"}'),
                    get('exl3_engine_step_phase_seconds_sum{phase="moe"}'),
                    get('exl3_engine_step_phase_seconds_count{phase="moe"}'))
        before = sums()
        generate(self.stub, PROMPTS[1])
        # One observation per step, as the phases (the last step's may still be on its way).
        wait_for(lambda: (lambda v: v[2] == v[4] > before[4])(sums()), 5,
                 "as many stage observations as steps")
        gate, experts, _, moe, _ = (a - b for a, b in zip(sums(), before))
        self.assertGreater(gate, 0)
        self.assertGreater(experts, 0)
        self.assertLessEqual(gate + experts, moe)

    def test_kv_capacity_in_bytes(self):
        """--kv-cache-bytes sizes the cache from the model's bytes per token (fp32 keys and values
        of every layer) in whole blocks of 16; DescribeModel states the tokens it came to, and a
        prompt beyond them is refused."""
        with open(os.path.join(self.model, "config.json")) as f:
            cfg = json.load(f)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_key_value_heads"] * head_dim * 4 * cfg["num_hidden_layers"]
        r = self.c.start_router(with_map=False,
                                extra=["--kv-cache-bytes", str((37 * 16 + 5) * per_token)])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)
        d = stub.DescribeModel(pb.DescribeModelRequest(), timeout=5)
        self.assertEqual(d.kv_capacity_tokens, 37 * 16)
        with self.assertRaises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[7] * (37 * 16 + 1),
                                                  max_tokens=1), timeout=10))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn(f"context of {37 * 16} tokens (the whole KV cache", e.exception.details())
        self.assertEqual(generate(stub, PROMPTS[0])[0], self.expected[0][0])

    def test_engine_metrics_exist_and_move(self):
        """Every engine metric of docs/metrics.md is exported, and a load with a prefix-cache
        hit, a full KV cache (preemption) and more sequences than --max-num-seqs moves each one
        that such a load can move."""
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs",
                               "metrics.md")) as f:
            doc = f.read()
        section = doc[doc.index("## Engine"):]
        names = re.findall(r"^\| `(exl3_engine_[a-z0-9_]+)` \| (\w+)", section, re.M)
        self.assertGreaterEqual(len(names), 18)
        # 64 blocks of 16: two sequences of 20 + 600 tokens (39 blocks each) cannot both fit, and
        # the third waits for one of them (long enough for the gauges, refreshed every 250 ms).
        r = self.c.start_router(with_map=False, extra=["--kv-cache-tokens", "1024",
                                                        "--max-num-seqs", "2"])
        channel = grpc.insecure_channel(r.address)
        self.addCleanup(channel.close)
        stub = pbg.GeneratorStub(channel)

        def text():
            return urllib.request.urlopen(f"http://{r.metrics}/metrics", timeout=5).read().decode()

        def value(t, series):
            m = re.search(rf"^{re.escape(series)} (\S+)$", t, re.M)
            return float(m.group(1)) if m else None

        def series_of(name, kind):
            if name == "exl3_engine_moe_stage_seconds":
                return [f'{name}_count{{stage="{s}"}}' for s in ("gate", "experts")]  # in process
            if name == "exl3_engine_first_token_write_seconds":
                return [f'{name}_count{{stage="{s}"}}' for s in ("started", "done")]
            if kind == "histogram":
                return [f"{name}_count"] if name != "exl3_engine_step_phase_seconds" else [
                    f'{name}_count{{phase="{p}"}}' for p in
                    ("embed", "attention", "moe", "dense_mlp", "head", "forward", "schedule",
                     "sample", "bookkeeping")]
            if name == "exl3_engine_requests_finished_total":
                return [f'{name}{{finish_reason="{f}"}}' for f in ("stop", "length", "abort",
                                                                   "error")]
            if name == "exl3_engine_spec_decode_num_accepted_tokens_per_pos_total":
                return []  # a series per draft position, with --speculative-method only
            return [name]

        before = text()
        for name, kind in names:
            for series in series_of(name, kind):
                self.assertIsNotNone(value(before, series), series)

        seen = {"exl3_engine_num_requests_running": 0.0, "exl3_engine_num_requests_waiting": 0.0,
                "exl3_engine_kv_cache_usage_ratio": 0.0}
        done = []

        def watch():
            while not done:
                t = text()
                for g in seen:
                    seen[g] = max(seen[g], value(t, g) or 0.0)
                time.sleep(0.01)
        watcher = concurrent.futures.ThreadPoolExecutor(1).submit(watch)
        try:
            shared = list(range(100, 140))  # 2 full blocks, cached after the first request
            generate(stub, shared, max_tokens=4)
            generate(stub, shared, max_tokens=4)
            with concurrent.futures.ThreadPoolExecutor(3) as ex:
                outs = list(ex.map(lambda i: generate(stub, [10 + i] * 20, max_tokens=600),
                                   range(3)))
        finally:
            done.append(True)
            watcher.result(timeout=10)
        self.assertTrue(all(len(o[0]) == 600 for o in outs))
        after = text()
        static = {"exl3_engine_failed_steps_total", "exl3_engine_num_requests_running",
                  "exl3_engine_num_requests_waiting", "exl3_engine_kv_cache_usage_ratio"}
        # Speculative decoding's counters stay 0 without --speculative-method; they move in
        # generate_speculative_system_test.py.
        static |= {name for name, _ in names if name.startswith("exl3_engine_spec_decode_")}
        for name, kind in names:
            if name in static:
                continue
            for series in series_of(name, kind):
                if 'finish_reason="length"' not in series and "finish_reason" in series:
                    continue
                self.assertGreater(value(after, series), value(before, series), series)
        for g, v in seen.items():
            self.assertGreater(v, 0.0, f"{g} never above 0 during the load")
        wait_for(lambda: value(text(), "exl3_engine_kv_cache_usage_ratio") == 0.0, 5,
                 "the KV usage metric back to 0")

    def test_deadline(self):
        """The request's timeout_us and the call's own gRPC deadline both end a request
        DEADLINE_EXCEEDED, and either way the engine lets go of its sequence and KV blocks."""
        kv = lambda: scrape(self.embedded.metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
        running = lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running")  # noqa: E731
        long = dict(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        for timeout_us, call_timeout in ((300000, 30), (0, 0.5)):
            t0 = time.monotonic()
            with self.assertRaises(grpc.RpcError) as e:
                list(self.stub.Generate(pb.GenerateRequest(timeout_us=timeout_us, **long),
                                        timeout=call_timeout))
            self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
            self.assertLess(time.monotonic() - t0, 5)
            wait_for(lambda: running() == 0 and kv() == 0, 5,
                     "the expired request's sequence to leave the engine and free its blocks")

    def test_stream_many_requests_on_one_call(self):
        """GenerateStream: 12 requests on one call (8 of them started by one message) give the
        tokens Generate gives each alone, each
        ends with one last update (status OK, its finish reason, usage and timings), a message
        carries the updates of several requests, and the call ends OK after the client
        half-closes."""
        call = StreamCall(self.stub)
        n = 12
        req = lambda i: pb.GenerateRequest(  # noqa: E731
            prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=12, ignore_eos=True,
            sampling=pb.SamplingParams(temperature=0))
        # The first 8 in one message (a burst), the rest one message each.
        call.send(*[pb.GenerateAction(stream_id=100 + i, start=req(i)) for i in range(8)])
        for i in range(8, n):
            call.send(pb.GenerateAction(stream_id=100 + i, start=req(i)))
        for i in range(n):
            last = call.last(100 + i)
            self.assertEqual(last.status_code, 0)
            self.assertEqual(last.response.finish_reason, pb.FINISH_REASON_LENGTH)
            self.assertEqual(last.response.usage.completion_tokens, 12)
            self.assertGreater(last.response.timings.total_seconds, 0)
            self.assertEqual(call.tokens(100 + i), self.expected[i % len(PROMPTS)][0], f"request {i}")
            self.assertEqual(sum(u.last for u in call.updates(100 + i)), 1)
        self.assertGreater(max(len({u.stream_id for u in m.updates}) for m in call.messages), 1,
                           "no message carried the updates of more than one request")
        call.half_close()
        call.wait(lambda c: c.status is not None, 10, "the call's end")
        self.assertEqual(call.status, grpc.StatusCode.OK)

    def test_stream_refusals_cancel_and_deadline(self):
        """On one call: a bad request is refused alone (INVALID_ARGUMENT, a last update without
        tokens) while another goes on; a cancelled request ends CANCELLED with FINISH_REASON_ABORT and frees its sequence; a
        request's timeout_us ends it DEADLINE_EXCEEDED; the call stays open for a new request
        throughout."""
        kv = lambda: scrape(self.embedded.metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
        running = lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running")  # noqa: E731
        call = StreamCall(self.stub)
        long = dict(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        call.start(1, **long)
        call.wait(lambda c: c.tokens(1), 20, "request 1's first token")
        call.start(2, prompt_token_ids=[], max_tokens=4)
        bad = call.last(2)
        self.assertEqual(bad.status_code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertIn("prompt", bad.status_message)
        self.assertEqual(len(bad.response.tokens), 0)
        n = len(call.tokens(1))
        call.wait(lambda c: len(c.tokens(1)) > n, 10, "request 1 to go on after the refusal")
        call.cancel(1)
        ended = call.last(1, timeout=10)
        self.assertEqual(ended.status_code, grpc.StatusCode.CANCELLED.value[0])
        self.assertEqual(ended.response.finish_reason, pb.FINISH_REASON_ABORT)
        wait_for(lambda: running() == 0 and kv() == 0, 10, "the cancelled sequence to leave")
        t0 = time.monotonic()
        call.start(3, timeout_us=300000, **long)
        late = call.last(3, timeout=10)
        self.assertEqual(late.status_code, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        self.assertLess(time.monotonic() - t0, 5)
        call.start(4, prompt_token_ids=PROMPTS[0], max_tokens=12, ignore_eos=True,
                   sampling=pb.SamplingParams(temperature=0))
        self.assertEqual(call.last(4).status_code, 0)
        self.assertEqual(call.tokens(4), self.expected[0][0])
        call.cancel(99)  # unknown: ignored
        call.half_close()
        call.wait(lambda c: c.status is not None, 10, "the call's end")
        self.assertEqual(call.status, grpc.StatusCode.OK)

    def test_stream_client_gone_cancels_its_requests(self):
        """A call its client cancels, or whose channel closes, ends every request on it: their
        sequences leave the engine and give back their KV blocks at once."""
        kv = lambda: scrape(self.embedded.metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
        running = lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running")  # noqa: E731
        long = dict(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        for close_channel in (False, True):
            channel = grpc.insecure_channel(self.embedded.address)
            call = StreamCall(pbg.GeneratorStub(channel))
            for i in range(3):
                call.start(i, **long)
            call.wait(lambda c: all(c.tokens(i) for i in range(3)), 20, "three running requests")
            wait_for(lambda: running() == 3, 5, "three requests in the running metric")
            if close_channel:
                channel.close()
            else:
                call.cancel_call()
            wait_for(lambda: running() == 0 and kv() == 0, 10,
                     "the abandoned call's sequences to leave the engine")
            call.wait(lambda c: c.status is not None, 10, "the call's end")
            self.assertEqual(call.status, grpc.StatusCode.CANCELLED)
            channel.close()

    def test_stream_broken_contract_ends_the_call(self):
        """A start for an id already open on the call, or an action with neither start nor cancel,
        ends the call INVALID_ARGUMENT (its updates could not be told apart) and every request on
        it with it."""
        running = lambda: scrape(self.embedded.metrics, "exl3_engine_num_requests_running")  # noqa: E731
        long = dict(prompt_token_ids=PROMPTS[1], max_tokens=3000, ignore_eos=True)
        for bad in ("duplicate", "empty"):
            call = StreamCall(self.stub)
            call.start(7, **long)
            call.wait(lambda c: c.tokens(7), 20, "request 7's first token")
            if bad == "duplicate":
                call.start(7, **long)
            else:
                call.send(pb.GenerateAction(stream_id=8))
            call.wait(lambda c: c.status is not None, 10, "the call's end")
            self.assertEqual(call.status, grpc.StatusCode.INVALID_ARGUMENT, bad)
            wait_for(lambda: running() == 0, 10, "the call's request to leave the engine")

    def test_replicas_share_the_load(self):
        """b2 replicates b (experts 4-7): under concurrent requests both compute sub-requests (each
        worker's own exl3_worker_requests_total), and the tokens are those of the router alone."""
        self.c.start_workers(("a", "b", "b2"))
        r = self.c.start_router()
        stub = pbg.GeneratorStub(grpc.insecure_channel(r.address))
        wait_for(lambda: stub.DescribeModel(pb.DescribeModelRequest(), timeout=2).experts ==
                 "workers" and generate(stub, [1], max_tokens=1), 30, "router with workers ready")
        metrics = {n: self.c.workers[n].wait_for_log(r"serving on \S+, metrics on (\S+)").group(1)
                   for n in ("a", "b", "b2")}

        def answered(name):
            text = urllib.request.urlopen(f"http://{metrics[name]}/metrics",
                                          timeout=5).read().decode()
            return sum(float(v) for v in
                       re.findall(r"^exl3_worker_requests_total\{[^}]*\} (\S+)$", text, re.M))
        before = {n: answered(n) for n in metrics}
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(generate, stub, PROMPTS[i % 4]) for i in range(16)]
            got = [f.result(timeout=120) for f in futs]
        for i, g in enumerate(got):
            self.assertEqual(g[0], self.expected[i % 4][0], i)
        done = {n: answered(n) - before[n] for n in metrics}
        print(f"\nsub-requests answered under 16 concurrent requests: {done}", file=sys.stderr)
        self.assertGreater(done["b"], 0)
        self.assertGreater(done["b2"], 0)
        # Spread, not a trickle: the replicas share experts 4-7's sub-requests within a factor 3.
        self.assertLess(max(done["b"], done["b2"]), 3 * min(done["b"], done["b2"]), done)

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
        # The MoE stages are the router core's then, not the engine's in-process ones; the engine
        # measures its own side of the calls: the time blocked on the workers' answers, within
        # the MoE phase.
        text = urllib.request.urlopen(f"http://{r.metrics}/metrics", timeout=5).read().decode()

        def series(name):
            return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))
        self.assertEqual(series('exl3_engine_moe_stage_seconds_count{stage="gate"}'), 0)
        self.assertGreater(series('exl3_engine_moe_stage_seconds_count{stage="wait"}'), 0)
        self.assertGreater(series('exl3_engine_moe_stage_seconds_sum{stage="wait"}'), 0)
        self.assertLessEqual(series('exl3_engine_moe_stage_seconds_sum{stage="wait"}'),
                             series('exl3_engine_step_phase_seconds_sum{phase="moe"}'))
        self.assertEqual(series('exl3_engine_moe_stage_seconds_sum{stage="to_host"}'), 0)  # CPU engine
        self.assertGreater(scrape(r.metrics, "exl3_router_layer_latency_seconds_count"), 0)

        # b (replicated by b2) killed under load: every request completes with the same tokens.
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(generate, stub, PROMPTS[i % 4], 40) for i in range(8)]
            time.sleep(0.3)
            self.c.workers["b"].kill9()
            got = [f.result(timeout=120) for f in futs]
        self.assertTrue(all(len(g[0]) == 40 for g in got))

        # a (the only holder of experts 0-3) killed mid-generation: the running requests fail
        # UNAVAILABLE naming the experts and their worker, none hangs; so does a new one.
        def fails(i):
            with self.assertRaises(grpc.RpcError) as e:
                generate(stub, PROMPTS[i % 4], 3000, timeout=60)
            return e.exception
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(fails, i) for i in range(4)]
            wait_for(lambda: scrape(r.metrics, "exl3_engine_num_requests_running") == 4, 10,
                     "four sequences running")
            self.c.workers["a"].kill9()
            t0 = time.time()
            errors = [f.result(timeout=30) for f in futs]
        errors.append(fails(0))
        self.assertLess(time.time() - t0, 15)
        for err in errors:
            self.assertEqual(err.code(), grpc.StatusCode.UNAVAILABLE, err.details())
            self.assertRegex(err.details(), r"experts [0-9]")
            self.assertIn("held by: a", err.details())
        wait_for(lambda: scrape(r.metrics, "exl3_engine_kv_cache_usage_ratio") == 0, 5,
                 "the failed sequences' blocks freed")
        # Restarted, it serves again without a router restart.
        self.c.start_worker("a")
        wait_for(lambda: generate(stub, PROMPTS[0])[0] == self.expected[0][0], 30,
                 "generation after the worker's restart")


if __name__ == "__main__":
    unittest.main()
