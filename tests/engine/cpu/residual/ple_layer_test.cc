// engine/cpu/residual/ple_layer against transformers' Qwen4ExpTextPLELayer on the qwen4_exp fixtures: the PLE
// input and output transformers recorded (reference.safetensors ple_in.1 / ple_out.1, the
// teacher-forced pass of prompt 1 and its continuation) reproduced from the EXL3 directory's
// n-gram table read in place, in one chunk and in chunks of 5 carried through the state store.
#include "engine/config/read_model_config.h"
#include "engine/cpu/residual/ple_layer.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <list>
#include <random>
#include <string>

#include "engine/config/model_config.h"
#include "engine/config/qwen4exp_config.h"
#include "gtest/gtest.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

void Check(const std::string& dir, const std::string& ref_path, int chunk) {
  auto cfg = LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  auto ref = TensorSource::Open(ref_path);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int layer = cfg->qwen4exp->ple.layers.at(0);
  auto ple = PleLayer::Load(*cfg, **src, layer);
  ASSERT_TRUE(ple.ok()) << ple.status();
  const std::vector<float> in = *ToFloat32(*(*ref)->Get("ple_in.1"));
  const std::vector<float> want = *ToFloat32(*(*ref)->Get("ple_out.1"));
  TensorView ids_view = *(*ref)->Get("ple_ids.1");
  const std::vector<int32_t> ids(ids_view.as<int32_t>(), ids_view.as<int32_t>() + ids_view.info->num_elements());
  const int T = static_cast<int>(ids.size());
  const size_t wide = in.size() / T;
  std::vector<int64_t> floats(cfg->num_layers, 0);
  floats[layer] = cfg->StateFloats(layer);
  auto states = SequenceStateStore::Create(floats, 1);
  ASSERT_TRUE(states.ok()) << states.status();
  CpuCompute compute(2);
  std::vector<float> got;
  for (int start = 0; start < T; start += chunk) {
    const int n = std::min(chunk, T - start);
    StepBatch batch;
    SequenceChunk c;
    c.tokens.assign(ids.begin() + start, ids.begin() + start + n);
    c.start_position = start;
    c.block_table = {0, 1, 2, 3, 4, 5};
    c.state_slot = 0;
    batch.chunks.push_back(c);
    StepTokens tokens;
    ASSERT_TRUE(FlattenStep(batch, cfg->vocab_size, KvCacheShape{6, 16, 1}, cfg->max_position_embeddings, &tokens).ok());
    ASSERT_TRUE((*states)->BeginStep(batch).ok());
    std::vector<float> h(in.begin() + start * wide, in.begin() + (start + n) * wide);
    const std::vector<float> h0 = h;
    ASSERT_TRUE((*ple)->Forward(h.data(), tokens, **states, compute).ok());
    for (size_t i = 0; i < h.size(); ++i) got.push_back(h[i] - h0[i]);  // the PLE's output
    (*states)->CommitStep(batch);
  }
  const double err = testing::RelativeError(got.data(), want.data(), want.size());
  EXPECT_LT(err, 1e-5) << dir << " in chunks of " << chunk;
  std::printf("%s PLE layer %d, chunks of %d: rel err %.2e\n", dir.c_str(), layer, chunk, err);
}

TEST(PleLayerTest, MatchesTransformers) {
  // release_all: PLE on layer 0 (straight after the stream expansion), n-gram rows of 160.
  for (const char* variant : {"experts", "all", "release_all"}) {
    const std::string dir = std::string("tests/fixtures/engine/qwen4_exp_") + variant;
    Check(dir, dir + "/reference.safetensors", 1000);
    Check(dir, dir + "/reference.safetensors", 5);
  }
}

// The GPU engine keeps the layer (its n-gram table reader) and drops the TensorSource once the
// weights are on the device: the rows it reads afterwards must not depend on the source (they
// once read each piece's dtype through the source's tensor index, freed by then: NaN rows).
TEST(PleLayerTest, EmbedsTheSameRowsAfterItsSourceIsClosed) {
  const std::string dir = "tests/fixtures/engine/qwen4_exp_all";
  auto cfg = LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const int layer = cfg->qwen4exp->ple.layers.at(0);
  auto src = TensorSource::Open(dir);
  ASSERT_TRUE(src.ok()) << src.status();
  auto kept = PleLayer::Load(*cfg, **src, layer);
  ASSERT_TRUE(kept.ok()) << kept.status();
  absl::StatusOr<std::unique_ptr<PleLayer>> orphan = absl::InternalError("not loaded");
  {
    auto own = TensorSource::Open(dir);
    ASSERT_TRUE(own.ok()) << own.status();
    orphan = PleLayer::Load(*cfg, **own, layer);
    ASSERT_TRUE(orphan.ok()) << orphan.status();
  }
  // Reuse the freed memory with bytes no index holds (0xff), so a read through it shows.
  std::list<std::vector<uint8_t>> churn;
  for (size_t size = 16; size <= (size_t{1} << 20); size *= 2)
    for (int i = 0; i < 8; ++i) churn.emplace_back(size, uint8_t{0xff});
  const int n = cfg->qwen4exp->ple.ngram_size, E = cfg->qwen4exp->ple.embed_dim, T = 9;
  std::mt19937 rng(7);
  std::vector<int32_t> windows(static_cast<size_t>(T) * n);
  for (int32_t& id : windows) id = static_cast<int32_t>(rng() % cfg->vocab_size);
  std::vector<float> want(static_cast<size_t>(T) * E), got(want.size(), -1.0f);
  ASSERT_TRUE((*kept)->Embed(windows.data(), T, want.data()).ok());
  ASSERT_TRUE((*orphan)->Embed(windows.data(), T, got.data()).ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
  for (float v : got) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace exl3::engine
