// DeepSeek-V4 model files the engine cannot run fail at Open with a message naming the tensor
// (a copy of tests/fixtures/engine/deepseek_v4_experts with one tensor left out or misshapen),
// and the cache footprint the scheduler plans with is the slot layout's.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "engine/cpu/cpu_model.h"
#include "engine/config/dsv4_config.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

constexpr char kFixture[] = "tests/fixtures/engine/deepseek_v4_experts";

// A model directory: the fixture's config.json and tensors, `drop` left out, `reshape` (if
// set) stored with its two dimensions swapped.
std::string CopyWithout(const std::string& drop, const std::string& reshape = "") {
  const fs::path dir = fs::temp_directory_path() / ("dsv4-model-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fs::path(kFixture) / "config.json", dir / "config.json");
  auto in = SafetensorsFile::Open(std::string(kFixture) + "/model.safetensors");
  EXPECT_TRUE(in.ok()) << in.status();
  SafetensorsWriter out;
  for (const TensorInfo& t : (*in)->tensors()) {
    if (t.name == drop) continue;
    TensorView v = *(*in)->Get(t.name);
    std::vector<int64_t> shape = t.shape;
    if (t.name == reshape && shape.size() == 2) std::swap(shape[0], shape[1]);
    out.Add(t.name, t.dtype, shape, v.data, v.size_bytes());
  }
  EXPECT_TRUE(out.Write((dir / "model.safetensors").string()).ok());
  return dir.string();
}

void ExpectOpenFails(const std::string& dir, const std::string& needle) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto m = CpuModel::Open(dir, o);
  ASSERT_FALSE(m.ok()) << needle;
  EXPECT_NE(std::string(m.status().message()).find(needle), std::string::npos) << m.status();
  fs::remove_all(dir);
}

TEST(Dsv4Model, MissingOrMisshapenTensorsAreNamed) {
  for (const char* name :
       {"model.hc_head.hc_fn", "model.layers.0.hc_attn_base", "model.layers.2.hc_ffn_scale",
        "model.layers.0.attn.attn_sink", "model.layers.1.attn.indexer.compressor.ape",
        "model.layers.2.attn.compressor.norm.weight", "model.layers.1.attn.wo_a.weight"}) {
    // A linear is found by its prefix (PREFIX.weight or PREFIX.trellis).
    std::string needle = name;
    if (needle.size() > 7 && needle.compare(needle.size() - 7, 7, ".weight") == 0 &&
        needle.find("norm") == std::string::npos)
      needle.resize(needle.size() - 7);
    ExpectOpenFails(CopyWithout(name), needle);
  }
  ExpectOpenFails(CopyWithout("", "model.layers.1.attn.compressor.ape"), "compressor.ape");
  ExpectOpenFails(CopyWithout("", "model.layers.1.hc_attn_fn"), "hc_attn_fn");
}

// The cache keeps per token only the shared key/value; compressed layers keep, per block, their
// compressors' running softmax and the entries of the windows closing in the block. Fixture:
// head_dim 128, index_head_dim 64, CSA m = 4, HCA m = 16, blocks of 16. The earlier layout kept
// every token's raw compressor projections: 128 + (128 + 512 + 128 + 256 + 64) + (128 + 256 +
// 128) = 1728 floats (6912 bytes) per token.
TEST(Dsv4Model, KvBytesPerTokenAreTheSlotsAndBlockAreas) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto m = CpuModel::Open(kFixture, o);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& cfg = (*m)->config();
  for (int l = 0; l < cfg.num_layers; ++l) EXPECT_EQ(cfg.KvWidth(l), 128);
  EXPECT_EQ(cfg.KvBlockFloats(0, 16), 0);  // sliding window: the slots only
  // CSA: count, accumulators 2 x [2, 128] + 2 x [2, 64], 4 entries of 128 and of 64.
  EXPECT_EQ(cfg.KvBlockFloats(1, 16), 1 + 512 + 256 + 4 * 128 + 4 * 64);
  // HCA: count, one accumulator [2, 128], one entry (a window spans the block).
  EXPECT_EQ(cfg.KvBlockFloats(2, 16), 1 + 256 + 128);
  EXPECT_EQ(cfg.KvBlockFloats(2, 64), 1 + 256 + 4 * 128);
  const int64_t per_block = 16 * 3 * 128 + 1537 + 385;
  EXPECT_EQ((*m)->info().kv_bytes_per_token, (per_block + 15) / 16 * 4);  // 505 floats
}

using testing::RelativeError;

// Runs tokens[start, end) of one sequence on `table` and returns the last token's logits.
absl::StatusOr<std::vector<float>> RunChunk(CpuModel& m, const std::vector<int32_t>& tokens, int start, int end,
                                            const std::vector<int32_t>& table, int64_t id) {
  StepBatch batch;
  SequenceChunk c;
  c.sequence_id = id;
  c.tokens.assign(tokens.begin() + start, tokens.begin() + end);
  c.start_position = start;
  c.block_table = table;
  c.wants_logits = true;
  batch.chunks.push_back(std::move(c));
  std::vector<float> logits(m.info().vocab_size);
  absl::Status st = m.Forward(batch, logits.data());
  if (!st.ok()) return st;
  return logits;
}

// A sequence continues from full blocks another sequence wrote (prefix caching: the
// compressors resume from the shared block's accumulators), and a chunk run twice (a failed
// step run again) changes nothing. Blocks of 16 (HCA windows fill a block) and of 8 (they span
// two blocks; CSA windows close two per block).
TEST(Dsv4Model, ResumesFromSharedBlocksAndRerunChunks) {
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(kFixture, o);
  ASSERT_TRUE(model.ok()) << model.status();
  CpuModel& m = **model;
  std::vector<int32_t> tokens(45);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37 + 11) % m.info().vocab_size);
  const int n = static_cast<int>(tokens.size());
  for (int B : {16, 8}) {
    const int per_seq = (n + B - 1) / B;
    ASSERT_TRUE(m.AllocateKvCache({4 * per_seq, B, 0}).ok());
    auto blocks = [&](int s) {
      std::vector<int32_t> t(per_seq);
      for (int b = 0; b < per_seq; ++b) t[b] = s * per_seq + b;
      return t;
    };
    auto whole = RunChunk(m, tokens, 0, n, blocks(0), 0);
    ASSERT_TRUE(whole.ok()) << whole.status();
    // Sequence 1: sequence 0's first two full blocks, then its own.
    std::vector<int32_t> shared = blocks(1);
    shared[0] = blocks(0)[0];
    shared[1] = blocks(0)[1];
    auto resumed = RunChunk(m, tokens, 2 * B, n, shared, 1);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_LT(RelativeError(*resumed, *whole), 1e-5) << "block size " << B;
    // Sequence 2: prefill, a chunk from inside a CSA and an HCA window run twice, the rest.
    ASSERT_TRUE(RunChunk(m, tokens, 0, 21, blocks(2), 2).ok());
    ASSERT_TRUE(RunChunk(m, tokens, 21, 30, blocks(2), 2).ok());
    ASSERT_TRUE(RunChunk(m, tokens, 21, 30, blocks(2), 2).ok());
    auto rerun = RunChunk(m, tokens, 30, n, blocks(2), 2);
    ASSERT_TRUE(rerun.ok()) << rerun.status();
    EXPECT_LT(RelativeError(*rerun, *whole), 1e-5) << "block size " << B;
    // A chunk that skips positions of a block (its block never written) is refused.
    auto gap = RunChunk(m, tokens, 35, 36, blocks(3), 3);
    ASSERT_FALSE(gap.ok());
    EXPECT_NE(std::string(gap.status().message()).find("folded positions"), std::string::npos) << gap.status();
  }
}

}  // namespace
}  // namespace exl3::engine
