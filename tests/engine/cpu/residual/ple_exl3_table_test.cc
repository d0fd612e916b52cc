// engine/cpu/residual/ple_layer with the n-gram table as exllamav3 quantizes it (`ngram_embedding.shard_i.trellis`
// and `head_bias`, model/exl3_ngram_rows.h): the qwen4_exp_all fixture with its table replaced
// by trellis rows gives exactly the output of the same fixture with the table replaced by those
// rows decoded (each with its head's bias) and stored as fp32 values: the pieces, the head of
// each row and its bias are found as exllamav3 finds them.
#include <filesystem>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/config/model_config.h"
#include "engine/cpu/residual/ngram_hash.h"
#include "engine/cpu/residual/ple_layer.h"
#include "engine/config/qwen4exp_config.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "model/exl3_ngram_rows.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

constexpr char kFixture[] = "tests/fixtures/engine/qwen4_exp_all";
constexpr int kBits = 4;

// The fixture's tensors but its table (`.ngram_embedding.` tensors), plus `extra`, in `dir`.
void WriteModel(const std::string& dir, const SafetensorsWriter& extra) {
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kFixture))
    if (e.path().extension() != ".safetensors" && e.path().filename() != "model.safetensors.index.json")
      fs::copy_file(e.path(), fs::path(dir) / e.path().filename());
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  SafetensorsWriter w;
  for (const std::string& name : (*src)->Names()) {
    if (name.find(".ngram_embedding.") != std::string::npos) continue;
    TensorView v = *(*src)->Get(name);
    w.Add(name, v.info->dtype, v.info->shape, v.data, v.size_bytes());
  }
  ASSERT_TRUE(w.Write(dir + "/model.safetensors").ok());
  ASSERT_TRUE(extra.Write(dir + "/table.safetensors").ok());
}

// The PLE output (what Forward adds) for prompt 1's recorded input, one chunk.
std::vector<float> PleOutput(const std::string& dir) {
  auto cfg = LoadModelConfig(dir);
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  auto src = TensorSource::Open(dir);
  EXPECT_TRUE(src.ok()) << src.status();
  auto ref = TensorSource::Open(std::string(kFixture) + "/reference.safetensors");
  const int layer = cfg->qwen4exp->ple.layers.at(0);
  auto ple = PleLayer::Load(*cfg, **src, layer);
  EXPECT_TRUE(ple.ok()) << ple.status();
  if (!ple.ok()) return {};
  std::vector<float> h = *ToFloat32(*(*ref)->Get("ple_in.1"));
  TensorView ids_view = *(*ref)->Get("ple_ids.1");
  StepBatch batch;
  SequenceChunk c;
  c.tokens.assign(ids_view.as<int32_t>(), ids_view.as<int32_t>() + ids_view.info->num_elements());
  c.block_table = {0, 1, 2, 3, 4, 5};
  batch.chunks.push_back(c);
  StepTokens tokens;
  EXPECT_TRUE(FlattenStep(batch, cfg->vocab_size, KvCacheShape{6, 16, 1}, cfg->max_position_embeddings, &tokens).ok());
  std::vector<int64_t> floats(cfg->num_layers, 0);
  floats[layer] = cfg->StateFloats(layer);
  auto states = SequenceStateStore::Create(floats, 1);
  EXPECT_TRUE((*states)->BeginStep(batch).ok());
  const std::vector<float> h0 = h;
  CpuCompute compute(2);
  EXPECT_TRUE((*ple)->Forward(h.data(), tokens, **states, compute).ok());
  for (size_t i = 0; i < h.size(); ++i) h[i] -= h0[i];
  return h;
}

TEST(PleExl3TableTest, TrellisRowsReadAsTheirDecodedValues) {
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const PleConfig& ple = cfg->qwen4exp->ple;
  const NgramHash hash = NgramHash::Build(ple, cfg->vocab_size, 0);
  const int D = ple.head_dim(), heads = hash.num_heads(), words = Exl3NgramWordsPerRow(D, kBits);
  const int64_t rows = hash.table_rows(), pieces = ple.split_parts, per_piece = rows / pieces;
  ASSERT_EQ(per_piece * pieces, rows);
  const std::string prefix = absl::StrCat("model.language_model.layers.", ple.layers.at(0),
                                          ".ple.ple_embedding.ngram_embedding.");

  std::mt19937 rng(5);
  std::vector<uint16_t> ring(static_cast<size_t>(rows) * words), bias(static_cast<size_t>(heads) * D);
  for (size_t i = 0; i < ring.size(); ++i)
    ring[i] = i % words == 0 ? FloatToHalfBits(0.02f + 0.001f * (i / words % 7)) : static_cast<uint16_t>(rng());
  for (uint16_t& b : bias) b = FloatToHalfBits(std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
  std::vector<int64_t> offsets;
  int64_t first = 0;
  for (int64_t size : hash.head_sizes()) offsets.push_back(first), first += size;

  SafetensorsWriter trellis, values;
  std::vector<float> decoded(static_cast<size_t>(rows) * D);
  for (int64_t r = 0; r < rows; ++r) {
    int head = 0;
    while (head + 1 < heads && offsets[head + 1] <= r) ++head;
    DecodeExl3NgramRow(&ring[r * words], D, kBits, &bias[static_cast<size_t>(head) * D], &decoded[r * D]);
  }
  for (int64_t p = 0; p < pieces; ++p) {
    trellis.Add(absl::StrCat(prefix, "shard_", p, ".trellis"), DType::kI16, {per_piece, words},
                &ring[p * per_piece * words], per_piece * words * 2);
    values.AddF32(absl::StrCat(prefix, "shard_", p, ".weight"), {per_piece, D}, &decoded[p * per_piece * D]);
  }
  trellis.Add(prefix + "head_bias", DType::kF16, {heads, D}, bias.data(), bias.size() * 2);
  trellis.Add(prefix + "head_offsets", DType::kI64, {heads}, offsets.data(), offsets.size() * 8);

  const std::string base = (fs::temp_directory_path() / ("ple_exl3_table_test_" + std::to_string(::getpid()))).string();
  WriteModel(base + "/trellis", trellis);
  WriteModel(base + "/values", values);
  const std::vector<float> got = PleOutput(base + "/trellis"), want = PleOutput(base + "/values");
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(got, want);
  fs::remove_all(base);
}

}  // namespace
}  // namespace exl3::engine
