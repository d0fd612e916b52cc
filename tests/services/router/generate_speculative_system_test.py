"""exl3-router with speculative decoding (--speculative-method ngram) through the whole stack, on
the GLM-4 MoE engine fixture (tests/fixtures/engine/glm4_moe_all): concurrent greedy requests
give transformers' continuations (the fixture's greedy.i), and a prompt built to repeat (a
fixture prompt, its continuation, then that continuation's first tokens again) and seeded
sampled requests give the tokens of a router without speculation, with the experts in the
router's process and on two exl3-worker processes; the spec_decode counters show accepted drafts.
The same on GLM-5.3-Flash's fixture (tests/fixtures/engine/glm5_next_all: KDA layers whose
recurrent state rolls back to the accepted drafts, the k-pooled indexer, hyper-connections) and
DeepSeek-V4's (tests/fixtures/engine/deepseek_v4_all: compressors rolled back to the accepted
drafts); DeepSeek-V4 asked for mtp is refused at start by name. With
--speculative-method mtp on the GLM-4 MoE MTP fixture (tests/fixtures/engine/glm4_moe_mtp) the
checkpoint's MTP head drafts: transformers' greedy tokens and a plain router's sampled ones,
experts in process and on two workers; a checkpoint without the MTP layer is refused by name.
The same with GLM-5.3-Flash's and Qwen4-Exp's MTP fixtures (tests/fixtures/engine/glm5_next_mtp,
qwen4_exp_mtp)."""

import concurrent.futures
import os
import re
import sys
import time
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(__file__))
from harness import Cluster, FixtureGenerateTest, ProcessExited, greedy_generate, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pbg  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "engine")
SPECULATIVE = ("--speculative-method", "ngram", "--num-speculative-tokens", "3",
               "--ngram-prompt-lookup-min", "1", "--ngram-prompt-lookup-max", "3")


def sampled(stub, prompt, max_tokens, seed):
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
    return [t.token_id for r in stub.Generate(req, timeout=120) for t in r.tokens]


def scrape(metrics):
    """{name{labels}: value} of a /metrics page."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


class SpeculativeRouterCases:
    """A plain router and one with SPEC_FLAGS (its start logged as STARTED_LOG) on the same files,
    experts in process and on two workers: the subclass's check(plain_stub, spec_stub, router)."""

    def test_experts_in_process(self):
        plain = self.c.start_router(with_map=False)
        spec = self.c.start_router(extra=self.SPEC_FLAGS, with_map=False)
        spec.wait_for_log(self.STARTED_LOG)
        with grpc.insecure_channel(plain.address) as pc, grpc.insecure_channel(spec.address) as sc:
            self.check(pbg.GeneratorStub(pc), pbg.GeneratorStub(sc), spec)

    def test_experts_on_workers(self):
        self.c.start_workers(("a", "b"))
        plain = self.c.start_router()
        spec = self.c.start_router(extra=self.SPEC_FLAGS)
        with grpc.insecure_channel(plain.address) as pc, grpc.insecure_channel(spec.address) as sc:
            plain_stub, spec_stub = pbg.GeneratorStub(pc), pbg.GeneratorStub(sc)
            self.wait_for_workers(plain_stub, pb)
            self.wait_for_workers(spec_stub, pb)
            self.check(plain_stub, spec_stub, spec)


class GenerateSpeculativeTest(SpeculativeRouterCases, FixtureGenerateTest):
    FIXTURE = os.path.join(FIXTURES, "glm4_moe_all")
    SPEC_FLAGS = SPECULATIVE
    STARTED_LOG = r"engine: speculative decoding ngram, 3 draft tokens per step, n-grams of 1 to 3"

    def repeating(self, i):
        return self.prompts[i] + self.greedy[i] + self.greedy[i][:4]

    def check(self, plain_stub, spec_stub, router):
        # Every fixture prompt and two repeating ones at once, greedy, through both routers.
        jobs = [(p, len(w)) for p, w in zip(self.prompts, self.greedy)]
        jobs += [(self.repeating(i), 32) for i in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            spec = list(ex.map(lambda j: greedy_generate(spec_stub, j[0], j[1], pb)[0], jobs))
        for i, want in enumerate(self.greedy):
            self.assertEqual(spec[i], want, f"fixture prompt {i}")
        for i in range(len(self.greedy), len(jobs)):
            self.assertEqual(spec[i], greedy_generate(plain_stub, *jobs[i], pb)[0], f"request {i}")
        # Seeded sampling: the same tokens with and without speculation.
        for seed in (7, 8):
            p = self.repeating(0)
            self.assertEqual(sampled(spec_stub, p, 24, seed), sampled(plain_stub, p, 24, seed))
        # The counters and gauges follow the engine's stats every 250 ms: until they show the
        # accepted drafts and the engine idle.
        m = wait_for(lambda: (m := scrape(router.metrics))["exl3_engine_kv_cache_usage_ratio"] == 0
                     and m["exl3_engine_num_requests_running"] == 0
                     and m["exl3_engine_spec_decode_num_accepted_tokens_total"] > 0 and m,
                     10, "accepted drafts counted and the engine idle")
        drafts = m["exl3_engine_spec_decode_num_draft_tokens_total"]
        accepted = m["exl3_engine_spec_decode_num_accepted_tokens_total"]
        first = m['exl3_engine_spec_decode_num_accepted_tokens_per_pos_total{position="0"}']
        print(f"spec_decode: {m['exl3_engine_spec_decode_num_drafts_total']:.0f} drafts, "
              f"{drafts:.0f} draft tokens, {accepted:.0f} accepted, {first:.0f} at position 0")
        self.assertLess(accepted, drafts)  # and some rejected
        self.assertGreater(first, 0)
        # Generator.EngineStats (what the front end shows as vllm:spec_decode_*): the engine's
        # totals, which the metrics above reach at their next refresh (every 250 ms).
        st = spec_stub.EngineStats(pb.EngineStatsRequest(), timeout=5)
        self.assertGreater(st.num_speculative_tokens, 0)
        self.assertEqual(len(st.spec_decode_num_accepted_tokens_per_pos), st.num_speculative_tokens)
        m = wait_for(lambda: (m := scrape(router.metrics))[
            "exl3_engine_spec_decode_num_drafts_total"] == st.spec_decode_num_drafts and m, 5,
            "the metrics refreshed to the engine's totals")
        self.assertEqual(st.spec_decode_num_draft_tokens,
                         m["exl3_engine_spec_decode_num_draft_tokens_total"])
        self.assertEqual(st.spec_decode_num_accepted_tokens,
                         m["exl3_engine_spec_decode_num_accepted_tokens_total"])
        self.assertEqual(st.spec_decode_num_accepted_tokens_per_pos[0],
                         m['exl3_engine_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'])



class GenerateSpeculativeGlm5NextTest(GenerateSpeculativeTest):
    """The cases above on a family with recurrent layers."""
    FIXTURE = os.path.join(FIXTURES, "glm5_next_all")


class GenerateSpeculativeDeepseekV4Test(GenerateSpeculativeTest):
    """The cases above on DeepSeek-V4 (compressors whose running softmax rolls back to the
    accepted drafts, hyper-connections)."""
    FIXTURE = os.path.join(FIXTURES, "deepseek_v4_all")


def capped(stub, prompt, max_tokens, k):
    """The greedy tokens of a request with GenerateRequest.num_speculative_tokens = k."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0), num_speculative_tokens=k)
    return [t.token_id for r in stub.Generate(req, timeout=120) for t in r.tokens]


class SpeculativeRequestSwitchTest(FixtureGenerateTest):
    """GenerateRequest.num_speculative_tokens through exl3-router (--speculative-draft-length
    adaptive): 0 drafts nothing for the request, 1..K cap it, the tokens those of a plain router;
    outside [0, K], or above 0 on a router without speculation, INVALID_ARGUMENT naming the field.
    The verify step histogram and the mean draft length gauge on /metrics."""
    FIXTURE = os.path.join(FIXTURES, "glm4_moe_all")

    def test_switch_caps_and_refusals(self):
        plain = self.c.start_router(with_map=False)
        spec = self.c.start_router(extra=SPECULATIVE + ("--speculative-draft-length", "adaptive"), with_map=False)
        spec.wait_for_log(r"engine: speculative decoding ngram, 3 draft tokens per step, n-grams of 1 to 3, "
                          r"draft length adaptive")
        prompt = self.prompts[0] + self.greedy[0] + self.greedy[0][:4]  # built to repeat
        drafts = "exl3_engine_spec_decode_num_draft_tokens_total"

        def settled(m):  # the engine idle and its counters refreshed (every 250 ms)
            return m["exl3_engine_num_requests_running"] == 0 and m

        with grpc.insecure_channel(plain.address) as pc, grpc.insecure_channel(spec.address) as sc:
            plain_stub, spec_stub = pbg.GeneratorStub(pc), pbg.GeneratorStub(sc)
            want = greedy_generate(plain_stub, prompt, 32, pb)[0]
            before = wait_for(lambda: settled(scrape(spec.metrics)), 10, "metrics")[drafts]
            self.assertEqual(capped(spec_stub, prompt, 32, 0), want)
            wait_for(lambda: settled(scrape(spec.metrics)), 10, "metrics")
            time.sleep(0.6)  # one more refresh after the request's last step
            self.assertEqual(scrape(spec.metrics)[drafts], before, "drafts for a request that turned them off")
            for k in (1, 3):
                self.assertEqual(capped(spec_stub, prompt, 32, k), want, f"num_speculative_tokens {k}")
            self.assertEqual(greedy_generate(spec_stub, prompt, 32, pb)[0], want)
            m = wait_for(lambda: (m := scrape(spec.metrics))[drafts] > before
                         and m["exl3_engine_spec_decode_verify_step_seconds_count"] > 0 and m,
                         10, "drafts and verify steps counted")
            self.assertIn("exl3_engine_spec_decode_mean_draft_length", m)
            for k in (4, -1):
                with self.assertRaises(grpc.RpcError) as e:
                    capped(spec_stub, prompt, 4, k)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("num_speculative_tokens must be in [0, 3]", e.exception.details())
            self.assertEqual(capped(plain_stub, prompt, 32, 0), want)
            with self.assertRaises(grpc.RpcError) as e:
                capped(plain_stub, prompt, 4, 2)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("num_speculative_tokens is 2 but this server runs without speculative decoding",
                          e.exception.details())

    def test_bad_draft_length_refused(self):
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=SPECULATIVE + ("--speculative-draft-length", "auto"), with_map=False)
        self.assertIn("is not one of: fixed, adaptive", str(e.exception))


class SpeculativeRefusedTest(FixtureGenerateTest):
    FIXTURE = os.path.join(FIXTURES, "deepseek_v4_all")

    def test_deepseek_v4_mtp_refused_at_start(self):
        # deepseek_v4_all has no DSPARK drafter (no MTP blocks in its config): refused by name.
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=MTP, with_map=False)
        self.assertRegex(str(e.exception), r"speculative method mtp refused for DeepseekV4ForCausalLM: "
                                           r"DeepseekV4ForCausalLM's config.json names no DSPARK mtp drafter")

    def test_bad_flags_refused(self):
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=("--speculative-method", "eagle"), with_map=False)
        self.assertIn("is not one of: off, ngram, mtp", str(e.exception))
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=("--speculative-method", "ngram"), with_map=False)
        self.assertIn("needs num_speculative_tokens >= 1", str(e.exception))


MTP = ("--speculative-method", "mtp", "--num-speculative-tokens", "2")
# The MTP fixture's 4 experts of its one decoder layer over two workers (its MTP layer's experts
# run in the router's process).
MTP_WORKER_MAP = """workers:
  - name: a
    address: 127.0.0.1:{a}
    experts: 0-1
  - name: b
    address: 127.0.0.1:{b}
    experts: 2-3
"""


class GenerateMtpTest(SpeculativeRouterCases, FixtureGenerateTest):
    """--speculative-method mtp on the GLM-4 MoE MTP fixture (tests/fixtures/engine/glm4_moe_mtp):
    greedy requests give transformers' continuations and seeded sampled ones a plain router's
    tokens, experts in process and on two workers; the MTP head's drafts are accepted."""

    FIXTURE = os.path.join(FIXTURES, "glm4_moe_mtp")
    SPEC_FLAGS = MTP
    STARTED_LOG = r"engine: speculative decoding mtp, 2 draft tokens per step"

    def setUp(self):
        super().setUp()
        self.c.write_map(MTP_WORKER_MAP)

    def check(self, plain_stub, spec_stub, router):
        jobs = [(p, len(w)) for p, w in zip(self.prompts, self.greedy)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            spec = list(ex.map(lambda j: greedy_generate(spec_stub, j[0], j[1], pb)[0], jobs))
        for i, want in enumerate(self.greedy):
            self.assertEqual(spec[i], want, f"fixture prompt {i}")
        for seed in (7, 8):
            p = self.prompts[1]
            self.assertEqual(sampled(spec_stub, p, 24, seed), sampled(plain_stub, p, 24, seed))
        m = wait_for(lambda: (m := scrape(router.metrics))["exl3_engine_kv_cache_usage_ratio"] == 0
                     and m["exl3_engine_num_requests_running"] == 0
                     and m["exl3_engine_spec_decode_num_accepted_tokens_total"] > 0 and m,
                     10, "accepted drafts counted and the engine idle")
        print(f"mtp spec_decode: {m['exl3_engine_spec_decode_num_drafts_total']:.0f} drafts, "
              f"{m['exl3_engine_spec_decode_num_draft_tokens_total']:.0f} draft tokens, "
              f"{m['exl3_engine_spec_decode_num_accepted_tokens_total']:.0f} accepted")


    def test_model_without_head_refused(self):
        self.c = Cluster(model=os.path.join(FIXTURES, "glm4_moe_all"))
        self.addCleanup(self.c.stop)
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=MTP, with_map=False)
        self.assertRegex(str(e.exception), r"speculative method mtp refused for Glm4MoeForCausalLM: "
                                           r"Glm4MoeForCausalLM checkpoint has no MTP layer")


class GenerateMtpGlm5NextTest(GenerateMtpTest):
    """The cases above on GLM-5.3-Flash's MTP fixture (tests/fixtures/engine/glm5_next_mtp): its
    MTP layer drafts from the hyper-connected streams' collapsed, normed state; the model's KDA
    layers roll back to the accepted drafts."""

    FIXTURE = os.path.join(FIXTURES, "glm5_next_mtp")

    def test_model_without_head_refused(self):
        self.c = Cluster(model=os.path.join(FIXTURES, "glm5_next_all"))
        self.addCleanup(self.c.stop)
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=MTP, with_map=False)
        self.assertRegex(str(e.exception), r"speculative method mtp refused for Glm5NextForConditionalGeneration: "
                                           r"Glm5NextForConditionalGeneration checkpoint has no MTP layer")


class GenerateMtpQwen4ExpTest(GenerateMtpTest):
    """The cases above on Qwen4-Exp's MTP fixture (tests/fixtures/engine/qwen4_exp_mtp): its MTP
    head drafts from the model's gated-residual streams; DeltaNet and PLE states roll back."""

    FIXTURE = os.path.join(FIXTURES, "qwen4_exp_mtp")

    def test_model_without_head_refused(self):
        self.c = Cluster(model=os.path.join(FIXTURES, "qwen4_exp_all"))
        self.addCleanup(self.c.stop)
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=MTP, with_map=False)
        self.assertRegex(str(e.exception), r"speculative method mtp refused for Qwen4ExpForConditionalGeneration: "
                                           r"Qwen4ExpForConditionalGeneration checkpoint has no MTP head of the "
                                           r"Qwen4-Exp design")


class GenerateMtpDeepseekV4Test(GenerateMtpTest):
    """The cases above on DeepSeek-V4's DSPARK fixture (tests/fixtures/engine/deepseek_v4_release_mtp,
    docs/dspark.md): the mtp.* block drafter drafts from the trunk's taps, as many drafts a round
    as its confidence head keeps; the compressed layers roll back to the accepted drafts."""

    FIXTURE = os.path.join(FIXTURES, "deepseek_v4_release_mtp")

    def setUp(self):
        super().setUp()
        self.c.write_map(MTP_WORKER_MAP.replace("experts: 0-1", "experts: 0-3").replace("experts: 2-3", "experts: 4-7"))

    def test_model_without_head_refused(self):
        self.c = Cluster(model=os.path.join(FIXTURES, "deepseek_v4_all"))
        self.addCleanup(self.c.stop)
        with self.assertRaises(ProcessExited) as e:
            self.c.start_router(extra=MTP, with_map=False)
        self.assertRegex(str(e.exception), r"speculative method mtp refused for DeepseekV4ForCausalLM: "
                                           r"DeepseekV4ForCausalLM's config.json names no DSPARK mtp drafter")


if __name__ == "__main__":
    unittest.main()
