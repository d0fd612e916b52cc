// DeepSeek-V4 model files the engine cannot run fail at Open with a message naming the tensor
// (a copy of tests/fixtures/engine/deepseek_v4_experts with one tensor left out or misshapen),
// and the cache footprint the scheduler plans with is the slot layout's.
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "engine/cpu_model.h"
#include "engine/dsv4_config.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

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

TEST(Dsv4Model, KvBytesPerTokenAreTheSlots) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto m = CpuModel::Open(kFixture, o);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& cfg = (*m)->config();
  int64_t floats = 0;
  for (int l = 0; l < cfg.num_layers; ++l)
    floats += SlotLayoutFor(*cfg.dsv4, cfg.dsv4->layer_types[l]).width;
  // sliding: kv 128; CSA: kv, compressor kv + gate 2 x 256, entry 128, indexer 2 x 128 + 64;
  // HCA: kv, compressor 2 x 128, entry.
  EXPECT_EQ(floats, 128 + (128 + 512 + 128 + 256 + 64) + (128 + 256 + 128));
  EXPECT_EQ((*m)->info().kv_bytes_per_token, floats * 4);
}

}  // namespace
}  // namespace exl3::engine
