// The MTP drafters (engine/cpu/mtp/mtp_drafter.h: engine/cpu/mtp/mtp_head.h, engine/cpu/mtp/qwen4exp_mtp_head.h) on the
// CPU model against transformers' own modules: the <family>_mtp fixtures
// (scripts/conformance/engine_fixtures.py --mtp-families) record the MTP layer's logits at every
// position of prompt + greedy continuation, computed in Python from the family's decoder layer
// (or attention and MoE) classes, its RMSNorm and nn.Linear with the formula in the drafter's header.
// The engine runs the model's steps keeping their hidden states, then the MTP layer over the
// kept positions: one prefill of the whole sequence, and chunks of 7 tokens (the MTP layer's KV
// carried between them). Also: models without the head, or runners without MTP, are refused.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/engine/engine_requests.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

using testing::Int32Rows;
using testing::RelativeError;

class MtpHeadTest : public ::testing::TestWithParam<const char*> {};

// MTP logits at positions [0, ids.size() - 1) of `ids`, the model run in chunks of `chunk` tokens.
std::vector<float> MtpLogitsInChunks(CpuModel& model, const std::vector<int32_t>& ids, int chunk) {
  const int L = static_cast<int>(ids.size());
  std::vector<int32_t> table;
  for (int b = 0; b * 16 < L; ++b) table.push_back(b);
  std::vector<float> all;
  for (int start = 0; start < L - 1; start += chunk) {
    const int n = std::min(chunk, L - start);
    StepBatch batch;
    batch.keep_hidden_states = true;
    SequenceChunk& c = batch.chunks.emplace_back();
    c.sequence_id = 7;
    c.tokens.assign(ids.begin() + start, ids.begin() + start + n);
    c.start_position = start;
    c.block_table = table;
    c.wants_logits = true;
    std::vector<float> logits(model.info().vocab_size);
    absl::Status st = model.Forward(batch, logits.data());
    EXPECT_TRUE(st.ok()) << st;
    MtpSpan span;
    span.sequence_id = 7;
    span.chunk_index = 0;
    span.start_position = start;
    span.num_positions = std::min(n, L - 1 - start);  // the last position has no next token
    span.next_tokens.assign(ids.begin() + start + 1, ids.begin() + start + 1 + span.num_positions);
    span.block_table = table;
    absl::StatusOr<std::vector<float>> rows = model.MtpLogits({&span, 1});
    EXPECT_TRUE(rows.ok()) << rows.status();
    if (!rows.ok()) return {};
    all.insert(all.end(), rows->begin(), rows->end());
  }
  return all;
}

TEST_P(MtpHeadTest, LogitsAtEveryPositionMatchTransformers) {
  const std::string dir = GetParam();
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto prompts = Int32Rows(**ref, "prompt."), greedy = Int32Rows(**ref, "greedy.");
  CpuModelOptions mo;
  mo.num_threads = 2;
  auto model = CpuModel::Open(dir, mo);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t plain_bytes = (*model)->info().kv_bytes_per_token;
  const absl::Status enabled = (*model)->EnableMtpDrafting();
  ASSERT_TRUE(enabled.ok()) << enabled;
  EXPECT_GT((*model)->info().kv_bytes_per_token, plain_bytes);  // the MTP layer's KV
  ASSERT_TRUE((*model)->AllocateKvCache({16, 16, 1}).ok());
  const int V = (*model)->info().vocab_size;
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<int32_t> ids = prompts[i];
    ids.insert(ids.end(), greedy[i].begin(), greedy[i].end());
    const std::vector<float> want = *ToFloat32(*(*ref)->Get("mtp_logits." + std::to_string(i)));
    ASSERT_EQ(want.size(), (ids.size() - 1) * V);
    for (int chunk : {static_cast<int>(ids.size()), 7}) {
      const std::vector<float> got = MtpLogitsInChunks(**model, ids, chunk);
      ASSERT_EQ(got.size(), want.size());
      double max_abs = 0, max_ref = 0;
      int argmax_equal = 0;
      const size_t rows = ids.size() - 1;
      for (size_t r = 0; r < rows; ++r) {
        const float* g = &got[r * V];
        const float* w = &want[r * V];
        argmax_equal += std::max_element(g, g + V) - g == std::max_element(w, w + V) - w;
      }
      for (size_t k = 0; k < want.size(); ++k) {
        max_abs = std::max(max_abs, std::abs(static_cast<double>(got[k]) - want[k]));
        max_ref = std::max(max_ref, std::abs(static_cast<double>(want[k])));
      }
      const double rel = RelativeError(got, want);
      EXPECT_LT(rel, 1e-4) << dir << " prompt " << i << " chunk " << chunk;
      EXPECT_EQ(argmax_equal, static_cast<int>(rows)) << dir << " prompt " << i << " chunk " << chunk;
      std::printf("%s prompt %zu (%zu positions, chunks of %d): MTP logits max|diff| %.3e (max|ref| %.2f), "
                  "|out-ref|/|ref| %.3e, argmax equal %d/%zu\n",
                  dir.c_str(), i, rows, chunk, max_abs, max_ref, rel, argmax_equal, rows);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, MtpHeadTest,
                         ::testing::Values("tests/fixtures/engine/deepseek_v3_mtp",
                                           "tests/fixtures/engine/glm4_moe_mtp",
                                           "tests/fixtures/engine/glm_moe_dsa_mtp",
                                           "tests/fixtures/engine/glm_moe_dsa_release_mtp",
                                           "tests/fixtures/engine/glm5_next_mtp",
                                           "tests/fixtures/engine/glm5_next_release_mtp",
                                           "tests/fixtures/engine/qwen4_exp_mtp",
                                           "tests/fixtures/engine/qwen4_exp_release_mtp"));

// Checkpoints of MTP families without the head (DeepSeek-V3, GLM-5.3-Flash: no layer
// {num_hidden_layers}; Qwen4-Exp: no mtp.* of its design) and a family without an MTP design:
// refused at start, by architecture and what is missing.
TEST(MtpHeadRefusal, ModelsWithoutTheHeadAreRefusedByName) {
  for (const char* dir : {"tests/fixtures/engine/deepseek_v3_all", "tests/fixtures/engine/qwen3_moe_all",
                          "tests/fixtures/engine/glm5_next_all", "tests/fixtures/engine/qwen4_exp_all"}) {
    CpuModelOptions mo;
    mo.num_threads = 1;
    auto model = CpuModel::Open(dir, mo);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::string arch = (*model)->info().architecture;
    EngineOptions eo;
    eo.scheduler.speculative.method = SpeculativeMethod::kMtp;
    eo.scheduler.speculative.num_speculative_tokens = 2;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
    Engine engine(eo, std::move(*model));
    const absl::Status st = engine.Start();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find(arch), std::string_view::npos) << st;
    EXPECT_NE(st.message().find("speculative method mtp"), std::string_view::npos) << st;
    std::printf("%s: %s\n", dir, std::string(st.message()).c_str());
  }
}

// Qwen4-Exp's head runs one MTP layer: a checkpoint with a second one (mtp.layers.1.*) is refused
// by name, not drafted from with its first layer alone.
TEST(MtpHeadRefusal, Qwen4ExpHeadOfTwoLayersIsRefusedByName) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("exl3_qwen4_two_mtp_layers_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy("tests/fixtures/engine/qwen4_exp_mtp", dir);
  const std::vector<float> q(256 * 128, 0.0f);
  SafetensorsWriter w;
  w.AddF32("mtp.layers.1.self_attn.q_proj.weight", {256, 128}, q.data());
  ASSERT_TRUE(w.Write((dir / "mtp_layer_1.safetensors").string()).ok());
  nlohmann::json index;
  std::ifstream(dir / "model.safetensors.index.json") >> index;
  index["weight_map"]["mtp.layers.1.self_attn.q_proj.weight"] = "mtp_layer_1.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  CpuModelOptions mo;
  mo.num_threads = 1;
  auto model = CpuModel::Open(dir.string(), mo);
  ASSERT_TRUE(model.ok()) << model.status();
  const absl::Status st = (*model)->CheckMtpDrafting();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("mtp.layers.1"), std::string_view::npos) << st;
  std::printf("%s\n", std::string(st.message()).c_str());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace exl3::engine
