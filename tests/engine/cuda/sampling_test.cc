// Sampling on the GPU (engine/cuda/device_sampler.h) against the CPU sampler (engine/sampling/sampler.h):
// on fresh random logits of vocabularies 1, 7, 1000 and 151552, 1 to 64 rows, every class of
// parameters (greedy, temperature, top-k, top-p, min-p, their combinations, repetition /
// presence / frequency penalties, bans, constraint masks, logprobs and top logprobs), the same tokens, logprobs
// within 1e-5 and the penalized logits bit for bit; then whole fixture models through the engine
// with sampling parameters: the GPU engine sampling on the device gives the tokens it gives
// sampling on the host, and the CPU engine's (greedy rows; seeded draws are reported where the
// GPU model's logits move them). Skipped where no GPU is visible (ctest label gpu).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/device_sampler.h"
#include "engine/core/engine.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/token_grammar.h"
#include "gtest/gtest.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"

namespace exl3::engine::cuda {
namespace {

// A row's history, owned (RowSampling's spans point into it).
struct OwnedHistory {
  std::vector<int32_t> prompt, output, banned;
  std::vector<uint32_t> allowed;  // a constraint's mask (engine/sampling/token_constraint.h)
};

// The shape of one test: the parameters of every row (rows cycle through them), the history
// lengths, and how the logits are drawn.
struct SamplingCase {
  std::string name;
  std::vector<SamplingParams> params;
  int max_prompt = 0, max_output = 0, num_banned = 0;
  enum class Logits { kNormal, kPeaked, kQuantized } logits = Logits::kNormal;
  float scale = 3.0f;
  // Above 0: every other row (the even ones) has a constraint's mask allowing about this share
  // of the tokens, one not banned always among them.
  double mask_density = 0;
};

std::vector<float> RandomLogits(size_t n, SamplingCase::Logits kind, float scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) {
    x = normal(rng);
    // Fresh values, never exactly 0 (a 0 would hide a sign or a missing write).
    if (x == 0.0f) x = 1e-3f;
  }
  if (kind == SamplingCase::Logits::kQuantized) {
    // Many exact ties: top-k, top-p and the arg max must break them by id as the CPU does.
    for (float& x : v) {
      x = std::round(x * 2.0f) * 0.5f + 0.125f;
    }
  } else if (kind == SamplingCase::Logits::kPeaked) {
    std::uniform_int_distribution<size_t> pick(0, n - 1);
    for (int i = 0; i < 3; ++i) v[pick(rng)] += 12.0f;
  }
  return v;
}

std::string Describe(const SamplingParams& p) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "T=%g top_k=%d top_p=%g min_p=%g rep=%g pres=%g freq=%g logprobs=%d",
                p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                p.frequency_penalty, p.logprobs.value_or(-1));
  return buf;
}

struct Counts {
  int rows = 0, token_mismatches = 0, logprob_checks = 0;
  double worst_logprob = 0;
};

// |a - b|, 0 where both are the same infinity (a masked token's logprob is -inf on both sides).
double LogprobDifference(float a, float b) { return a == b ? 0.0 : std::fabs(static_cast<double>(a) - b); }

void CheckCase(const SamplingCase& c, int vocab, int num_rows, uint64_t seed, Counts* counts) {
  SCOPED_TRACE(c.name + ", vocab " + std::to_string(vocab) + ", rows " + std::to_string(num_rows));
  std::mt19937 rng(static_cast<uint32_t>(seed * 7919 + vocab + num_rows));
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::vector<OwnedHistory> histories(num_rows);
  std::vector<RowSampling> rows(num_rows);
  for (int r = 0; r < num_rows; ++r) {
    OwnedHistory& h = histories[r];
    std::uniform_int_distribution<int> prompt_len(c.max_prompt > 0 ? 1 : 0, c.max_prompt);
    std::uniform_int_distribution<int> output_len(0, c.max_output);
    h.prompt.resize(prompt_len(rng));
    for (int32_t& t : h.prompt) t = token(rng);
    h.output.resize(output_len(rng));
    // Outputs repeat tokens, so the frequency counts exceed 1.
    for (int32_t& t : h.output) t = token(rng) % std::max(1, vocab / 4 + 1);
    for (int i = 0; i < c.num_banned; ++i) h.banned.push_back(token(rng));
    rows[r].params = c.params[r % c.params.size()];
    rows[r].seed = seed * 1000 + r;
    rows[r].history = {h.prompt, h.output, h.banned};
    // A token not banned to keep allowed (none where every token is banned: no mask then).
    int32_t keep = token(rng);
    for (int tries = 0; tries < vocab && std::find(h.banned.begin(), h.banned.end(), keep) != h.banned.end(); ++tries)
      keep = (keep + 1) % vocab;
    const bool any_unbanned = std::find(h.banned.begin(), h.banned.end(), keep) == h.banned.end();
    if (c.mask_density > 0 && r % 2 == 0 && any_unbanned) {
      std::bernoulli_distribution allow(c.mask_density);
      h.allowed.assign((vocab + 31) / 32, 0u);
      for (int t = 0; t < vocab; ++t) {
        if (allow(rng)) h.allowed[t / 32] |= 1u << (t % 32);
      }
      h.allowed[keep / 32] |= 1u << (keep % 32);
      rows[r].history.allowed_tokens = h.allowed;
    }
  }
  const std::vector<float> logits = RandomLogits(static_cast<size_t>(num_rows) * vocab, c.logits, c.scale, rng);

  // The device.
  DeviceArray<float> d_logits;
  ASSERT_TRUE(d_logits.Upload(logits).ok());
  DeviceSampler device(vocab);
  const absl::Status launched = device.Launch(d_logits.get(), rows, nullptr);
  ASSERT_TRUE(launched.ok()) << launched;
  ASSERT_TRUE(exl3::cuda::Synchronize().ok());
  std::vector<SampledToken> got(num_rows);
  device.Collect(got);
  std::vector<float> device_rows(logits.size());
  ASSERT_TRUE(exl3::cuda::CopyToHost(device_rows.data(), d_logits.get(), logits.size() * sizeof(float)).ok());
  // A masked row as the device kept it for a host redraw: the logits with -inf where the mask
  // is 0, bit for bit.
  for (int r = 0; r < num_rows; ++r) {
    std::vector<float> kept(vocab);
    const absl::Status masked = device.MaskedRow(r, kept, nullptr);
    if (histories[r].allowed.empty()) {
      EXPECT_EQ(masked.code(), absl::StatusCode::kNotFound) << "row " << r;
      continue;
    }
    ASSERT_TRUE(masked.ok()) << masked;
    int differ = 0;
    for (int t = 0; t < vocab; ++t) {
      const bool allowed = (histories[r].allowed[t / 32] >> (t % 32)) & 1u;
      const float want = allowed ? logits[static_cast<size_t>(r) * vocab + t] : -INFINITY;
      differ += kept[t] != want;
    }
    EXPECT_EQ(differ, 0) << "row " << r << ": masked logits differ at " << differ << " tokens";
  }

  // The host.
  Sampler host(vocab);
  for (int r = 0; r < num_rows; ++r) {
    const RowSampling& rs = rows[r];
    std::vector<float> row(logits.begin() + static_cast<size_t>(r) * vocab,
                           logits.begin() + static_cast<size_t>(r + 1) * vocab);
    const SampledToken want = host.Sample(row, rs.params, rs.seed, rs.history);
    const SampledToken& g = got[r];
    ++counts->rows;
    const std::string where = "row " + std::to_string(r) + " (" + Describe(rs.params) + ", prompt " +
                              std::to_string(rs.history.prompt.size()) + ", output " +
                              std::to_string(rs.history.output.size()) + ")";
    if (g.token != want.token) {
      ++counts->token_mismatches;
      const float* raw = &logits[static_cast<size_t>(r) * vocab];
      ADD_FAILURE() << where << ": device token " << g.token << ", CPU " << want.token << " (raw logits "
                    << (g.token >= 0 && g.token < vocab ? raw[g.token] : NAN) << " and " << raw[want.token]
                    << ", uniform " << Sampler::UniformDraw(rs.seed, rs.history.output.size()) << ")";
    }
    // Greedy leaves the penalized row in the CPU's scratch: the device's must be the same bits.
    if (rs.params.temperature == 0.0f) {
      int differ = 0, first = -1;
      for (int t = 0; t < vocab; ++t) {
        const float d = device_rows[static_cast<size_t>(r) * vocab + t];
        if (!(d == row[t] || (std::isnan(d) && std::isnan(row[t])))) {
          if (first < 0) first = t;
          ++differ;
        }
      }
      EXPECT_EQ(differ, 0) << where << ": penalized logits differ from the CPU's at " << differ
                           << " tokens, first " << first << ": device "
                           << device_rows[static_cast<size_t>(r) * vocab + std::max(first, 0)] << ", CPU "
                           << row[std::max(first, 0)];
    }
    ASSERT_EQ(g.logprob.has_value(), want.logprob.has_value()) << where;
    if (want.logprob.has_value() && g.token == want.token) {
      const double d = LogprobDifference(*g.logprob, *want.logprob);
      counts->worst_logprob = std::max(counts->worst_logprob, d);
      ++counts->logprob_checks;
      EXPECT_LE(d, 1e-5) << where << ": logprob " << *g.logprob << ", CPU " << *want.logprob;
    }
    ASSERT_EQ(g.top_logprobs.size(), want.top_logprobs.size()) << where;
    for (size_t i = 0; i < want.top_logprobs.size(); ++i) {
      EXPECT_EQ(g.top_logprobs[i].token, want.top_logprobs[i].token) << where << ": top " << i;
      const double d = LogprobDifference(g.top_logprobs[i].logprob, want.top_logprobs[i].logprob);
      counts->worst_logprob = std::max(counts->worst_logprob, d);
      EXPECT_LE(d, 1e-5) << where << ": top " << i << " logprob " << g.top_logprobs[i].logprob << ", CPU "
                         << want.top_logprobs[i].logprob;
      if (g.top_logprobs[i].token != want.top_logprobs[i].token) break;
    }
  }
}

SamplingParams Greedy() {
  SamplingParams p;
  p.temperature = 0;
  return p;
}

SamplingParams Sampled(float temperature, int top_k, float top_p, float min_p) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

SamplingParams Penalized(SamplingParams p, float repetition, float presence, float frequency) {
  p.repetition_penalty = repetition;
  p.presence_penalty = presence;
  p.frequency_penalty = frequency;
  return p;
}

SamplingParams WithLogprobs(SamplingParams p, int n) {
  p.logprobs = n;
  return p;
}

std::vector<SamplingCase> Cases(int vocab) {
  using L = SamplingCase::Logits;
  const int big_top = std::min(vocab, kMaxDeviceTopLogprobs);
  std::vector<SamplingCase> cases = {
      {"greedy", {Greedy()}},
      {"greedy with ties", {Greedy()}, 0, 0, 0, L::kQuantized},
      {"greedy, penalties and bans", {Penalized(Greedy(), 1.3f, 0.4f, 0.2f), Penalized(Greedy(), 0.8f, -0.3f, 0.5f)},
       300, 60, 3},
      {"temperature", {Sampled(0.7f, 0, 1, 0), Sampled(1.0f, 0, 1, 0), Sampled(2.5f, 0, 1, 0)}},
      {"top-k", {Sampled(1.0f, 40, 1, 0), Sampled(0.8f, 1, 1, 0), Sampled(1.0f, std::max(1, vocab - 1), 1, 0)}},
      {"top-k with ties", {Sampled(1.0f, 5, 1, 0), Sampled(1.0f, 100, 1, 0)}, 0, 0, 0, L::kQuantized},
      {"top-p", {Sampled(1.0f, 0, 0.9f, 0), Sampled(0.6f, 0, 0.5f, 0), Sampled(1.2f, 0, 0.99f, 0)}},
      {"top-p with ties", {Sampled(1.0f, 0, 0.7f, 0), Sampled(1.0f, 0, 0.3f, 0)}, 0, 0, 0, L::kQuantized},
      {"top-p peaked", {Sampled(1.0f, 0, 0.9f, 0), Sampled(1.0f, 0, 0.999f, 0)}, 0, 0, 0, L::kPeaked},
      {"min-p", {Sampled(1.0f, 0, 1, 0.05f), Sampled(0.9f, 0, 1, 0.3f)}},
      {"top-k + top-p + min-p", {Sampled(0.8f, 50, 0.95f, 0.02f), Sampled(1.0f, 200, 0.8f, 0.01f)}},
      {"everything, penalties, bans, logprobs",
       {WithLogprobs(Penalized(Sampled(0.8f, 50, 0.95f, 0.02f), 1.2f, 0.3f, 0.1f), 5),
        WithLogprobs(Penalized(Sampled(1.1f, 0, 0.9f, 0), 1.1f, 0, 0), 0),
        Penalized(Sampled(0.7f, 20, 1, 0), 1, 0.5f, 0.5f)},
       200, 40, 2},
      {"logprobs", {WithLogprobs(Greedy(), 20), WithLogprobs(Sampled(1.0f, 0, 0.9f, 0), 1),
                    WithLogprobs(Sampled(1.0f, 10, 1, 0), big_top), WithLogprobs(Greedy(), 0)}},
      {"logprobs with ties", {WithLogprobs(Greedy(), 20), WithLogprobs(Sampled(1.0f, 0, 1, 0), big_top)},
       0, 0, 0, L::kQuantized},
      {"mixed rows", {Greedy(), Sampled(0.8f, 50, 0.9f, 0), Penalized(Sampled(1.0f, 0, 1, 0.1f), 1.5f, 0, 0),
                      WithLogprobs(Penalized(Greedy(), 1.0f, 1.0f, 0.0f), 3)},
       100, 30, 1},
      {"constraint masks, sparse",
       {WithLogprobs(Greedy(), 5), WithLogprobs(Sampled(1.0f, 0, 0.9f, 0), 2),
        Penalized(Sampled(0.8f, 40, 1, 0.02f), 1.2f, 0.3f, 0.1f)},
       100, 30, 1, L::kNormal, 3.0f, 0.02},
      {"constraint masks, dense",
       {WithLogprobs(Penalized(Greedy(), 1.3f, 0, 0), 3), WithLogprobs(Sampled(0.7f, 20, 0.95f, 0), 1)},
       100, 30, 2, L::kNormal, 3.0f, 0.9},
  };
  return cases;
}

TEST(DeviceSamplerTest, MatchesTheCpuSampler) {
  REQUIRE_GPU();
  uint64_t seed = 1;
  for (int vocab : {1, 7, 1000, 151552}) {
    Counts counts;
    for (const SamplingCase& c : Cases(vocab)) {
      for (int rows : {1, 5, 64}) {
        if (vocab == 151552 && rows == 5) continue;  // 1 and 64 cover the large vocabulary
        CheckCase(c, vocab, rows, seed++, &counts);
      }
    }
    std::printf("device sampler, vocab %6d: %d rows, token mismatches %d, logprobs checked %d, worst |dlogprob| %.2e\n",
                vocab, counts.rows, counts.token_mismatches, counts.logprob_checks, counts.worst_logprob);
  }
}

// Every path of the kernel once, small enough for compute-sanitizer (scripts/gpu/engine.sh).
TEST(DeviceSamplerTest, EveryPathOnce) {
  REQUIRE_GPU();
  Counts counts;
  uint64_t seed = 77;
  for (const SamplingCase& c : Cases(5000)) {
    if (c.name.find("everything") == std::string::npos && c.name.find("mixed") == std::string::npos &&
        c.name.find("constraint") == std::string::npos && c.name != "logprobs")
      continue;
    CheckCase(c, 5000, 4, seed++, &counts);
  }
  EXPECT_EQ(counts.token_mismatches, 0);
}

TEST(DeviceSamplerTest, SameSeedSameTokensAndEveryTokenBannedGivesZero) {
  REQUIRE_GPU();
  const int vocab = 7;
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f, 1.0f};
  std::vector<int32_t> all = {0, 1, 2, 3, 4, 5, 6};
  std::vector<RowSampling> rows(4);
  for (RowSampling& r : rows) r.params = Sampled(1.0f, 0, 1, 0);
  rows[0].seed = rows[1].seed = 99;
  rows[2].history.banned_tokens = all;
  rows[3].params = Greedy();
  rows[3].history.banned_tokens = all;
  std::vector<float> batch;
  for (int r = 0; r < 4; ++r) batch.insert(batch.end(), logits.begin(), logits.end());
  DeviceArray<float> d;
  ASSERT_TRUE(d.Upload(batch).ok());
  DeviceSampler device(vocab);
  ASSERT_TRUE(device.Launch(d.get(), rows, nullptr).ok());
  ASSERT_TRUE(exl3::cuda::Synchronize().ok());
  std::vector<SampledToken> got(4);
  device.Collect(got);
  EXPECT_EQ(got[0].token, got[1].token);
  EXPECT_EQ(got[2].token, 0);  // as the CPU sampler: nothing sensible left
  EXPECT_EQ(got[3].token, 0);
  SamplingParams too_many;
  too_many.logprobs = kMaxDeviceTopLogprobs + 1;
  EXPECT_FALSE(DeviceSampler::Supports(too_many));
}

#if EXL3_TEST_STRUCTURED_OUTPUT
TEST(DeviceSamplerTest, TakesConstraintsButNoLogitBias) {
  // Host logic, no GPU: logit_bias rows are sampled on the host (engine/core/engine.cc RunForward);
  // a constrained row brings its mask in its history.
  SamplingParams biased;
  biased.logit_bias = {{3, 5.0f}};
  EXPECT_FALSE(DeviceSampler::Supports(biased));
  std::ifstream in("tests/fixtures/tokenizer/glm4_moe/tokenizer.json");
  std::stringstream text;
  text << in.rdbuf();
  auto compiler = TokenGrammarCompiler::FromTokenizerJson(text.str(), 512, {1});
  ASSERT_TRUE(compiler.ok()) << compiler.status();
  auto grammar = (*compiler)->Compile({ConstraintKind::kJsonObject, "", {}, {}});
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  SamplingParams constrained;
  constrained.grammar = *grammar;
  EXPECT_TRUE(DeviceSampler::Supports(constrained));
  EXPECT_TRUE(DeviceSampler::Supports(SamplingParams{}));
}
#endif

// ---------------------------------------------------------------------------------------------
// Whole models through the engine.

struct EngineRun {
  std::vector<std::vector<SampledToken>> sampled;
};

std::vector<GenerateParams> SampledRequests(const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<GenerateParams> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateParams g = testing::Greedy32(prompts[i], /*logprobs=*/3);
    SamplingParams& s = g.sampling;
    switch (i % 3) {
      case 0:  // greedy with penalties
        s.repetition_penalty = 1.3f;
        s.presence_penalty = 0.2f;
        break;
      case 1:  // seeded sampling, peaked enough that the GPU's logits (5e-3 off) rarely move it
        s.temperature = 0.5f;
        s.top_k = 20;
        s.top_p = 0.9f;
        s.frequency_penalty = 0.3f;
        s.seed = 7 + i;
        break;
      case 2:
        s.temperature = 0.8f;
        s.min_p = 0.1f;
        s.repetition_penalty = 1.1f;
        s.seed = 11 + i;
        g.min_tokens = 4;
        break;
    }
    out.push_back(g);
  }
  return out;
}

// One request after the other (so that every engine runs the same steps: the GPU model's logits
// depend on the batch's shape), each prompt in chunks of 5 before its decode steps.
std::vector<std::vector<SampledToken>> RunEngine(std::unique_ptr<ModelRunner> runner,
                                                 const std::vector<GenerateParams>& params) {
  EngineOptions eo;
  eo.block_size = 16;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 256};
  eo.scheduler.max_num_batched_tokens = 5;
  Engine engine(eo, std::move(runner));
  EXPECT_TRUE(engine.Start().ok());
  std::vector<std::vector<SampledToken>> out;
  for (const GenerateParams& p : params) {
    std::vector<std::vector<SampledToken>> one = testing::RunAllAtOnce(engine, {p});
    out.push_back(one.empty() ? std::vector<SampledToken>{} : std::move(one[0]));
  }
  engine.Stop();
  return out;
}

class DeviceSamplingFixtureTest : public ::testing::TestWithParam<const char*> {};

TEST_P(DeviceSamplingFixtureTest, EngineTokensMatchHostSamplingAndTheCpuEngine) {
  REQUIRE_GPU();
  const std::string dir = std::string("tests/fixtures/engine/") + GetParam();
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<GenerateParams> params = SampledRequests(testing::Int32Rows(**ref, "prompt."));
  ASSERT_FALSE(params.empty());

  CpuModelOptions co;
  co.num_threads = 2;
  auto cpu = CpuModel::Open(dir, co);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const auto cpu_out = RunEngine(std::move(*cpu), params);
  auto open_gpu = [&](bool device_sampling) -> std::unique_ptr<ModelRunner> {
    CudaModelOptions o;
    o.device_sampling = device_sampling;
    auto m = CudaModel::Open(dir, o);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  };
  const auto device_out = RunEngine(open_gpu(true), params);
  const auto host_out = RunEngine(open_gpu(false), params);
  ASSERT_EQ(device_out.size(), params.size());
  ASSERT_EQ(host_out.size(), params.size());
  ASSERT_EQ(cpu_out.size(), params.size());

  int same_as_host = 0, same_as_cpu = 0, total = 0;
  double worst_host_logprob = 0, worst_cpu_logprob = 0;
  // The host run's logprob error relative to the token's logprob (at least 1): an unlikely
  // token's logprob is a large number whose last bits move as much as the logits' do.
  double worst_host_relative = 0, worst_host_at = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string what = "request " + std::to_string(i) + " (" + Describe(params[i].sampling) + ")";
    ASSERT_EQ(device_out[i].size(), host_out[i].size()) << what;
    ASSERT_EQ(device_out[i].size(), cpu_out[i].size()) << what;
    bool host_diverged = false, cpu_diverged = false;
    for (size_t t = 0; t < device_out[i].size(); ++t) {
      const SampledToken& d = device_out[i][t];
      ++total;
      if (!host_diverged) {
        if (d.token == host_out[i][t].token) {
          ++same_as_host;
          const double diff = std::fabs(*d.logprob - *host_out[i][t].logprob);
          worst_host_logprob = std::max(worst_host_logprob, diff);
          const double relative = diff / std::max(1.0, std::fabs(static_cast<double>(*host_out[i][t].logprob)));
          if (relative > worst_host_relative) {
            worst_host_relative = relative;
            worst_host_at = *host_out[i][t].logprob;
          }
        } else {
          host_diverged = true;
          ADD_FAILURE() << what << " token " << t << ": device sampling " << d.token << ", host sampling "
                        << host_out[i][t].token << " (two runs of the GPU model, whose logits are taken to be the same)";
        }
      }
      if (!cpu_diverged) {
        if (d.token == cpu_out[i][t].token) {
          ++same_as_cpu;
          worst_cpu_logprob = std::max<double>(worst_cpu_logprob, std::fabs(*d.logprob - *cpu_out[i][t].logprob));
        } else {
          cpu_diverged = true;
          // Greedy must agree as the greedy fixture tests do. A seeded draw can land within the
          // GPU model's logit error (5e-3 relative) of a boundary between two tokens: reported.
          const bool greedy = params[i].sampling.temperature == 0.0f;
          std::printf("%s%s token %zu: GPU engine %d (logprob %.5f), CPU engine %d (logprob %.5f)\n",
                      greedy ? "FAIL " : "diverged (seeded draw) ", what.c_str(), t, d.token, *d.logprob,
                      cpu_out[i][t].token, *cpu_out[i][t].logprob);
          if (greedy) ADD_FAILURE() << what << " token " << t << ": GPU engine " << d.token << ", CPU engine "
                                    << cpu_out[i][t].token;
        }
      }
    }
  }
  std::printf("model %-20s sampled: device=host sampling %d/%d (worst |dlogprob| %.2e; relative %.2e at "
              "logprob %.3f), GPU=CPU engine %d/%d (worst |dlogprob| %.2e)\n",
              GetParam(), same_as_host, total, worst_host_logprob, worst_host_relative, worst_host_at,
              same_as_cpu, total, worst_cpu_logprob);
  // Two runs of the GPU model: the linear kernels add their k-slices' sums with fp32 atomics, so the
  // logits of two runs differ in their last bits, grown over the layers (measured up to 2.7e-3 in
  // logprob on glm4_moe_all on the H200; on the H100 with the draws of issue 28's seeding, tokens
  // all equal, 1.6e-2 and 1.9e-2 in two runs, 8.7e-3 of the token's logprob of -1.2); the tokens
  // must still be the same (above), and the logprobs within 2e-2 of the token's logprob (or of 1).
  EXPECT_LE(worst_host_relative, 2e-2);
}

INSTANTIATE_TEST_SUITE_P(GqaFamilies, DeviceSamplingFixtureTest,
                         ::testing::Values("glm4_moe_all", "qwen3_moe_experts", "mixtral_all"));

}  // namespace
}  // namespace exl3::engine::cuda
