#include "model/safetensors.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace exl3 {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("exl3_st_" + name)).string();
}

void WriteRaw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  f << std::string(data_bytes, '\x01');
}

TEST(Safetensors, WritesAndReadsBack) {
  SafetensorsWriter w;
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  uint16_t b[3] = {0x3c00, 0x4000, 0xbc00};
  w.AddF32("a", {2, 3}, a.data());
  w.Add("b", DType::kF16, {3}, b, sizeof(b));
  w.AddMetadata("format", "pt");
  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto ta = (*f)->Get("a");
  ASSERT_TRUE(ta.ok());
  EXPECT_EQ(ta->info->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ta->data, a.data(), 24), 0);
  auto tb = ToFloat32(*(*f)->Get("b"));
  ASSERT_TRUE(tb.ok());
  EXPECT_EQ((*tb)[2], -1.0f);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->Get("missing").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

TEST(Safetensors, HeaderPaddingSetsWhereTheDataSectionStarts) {
  const std::vector<SafetensorsEntry> entries = {{"a.trellis", DType::kI16, {4, 8}, 64},
                                                 {"a.suh", DType::kF16, {128}, 256}};
  for (size_t extra = 0; extra < 20; ++extra) {  // metadata of every length mod 16
    const std::map<std::string, std::string> meta = {{"format", "pt" + std::string(extra, 'x')}};
    const std::string aligned = SafetensorsHeaderText(entries, meta);
    EXPECT_EQ((aligned.size() + 8) % 64, 0u);
    const std::string shifted = SafetensorsHeaderText(entries, meta, DataSectionStart::k8PastA16ByteBoundary);
    EXPECT_EQ((shifted.size() + 8) % 16, 8u) << extra;
    // Still a valid file: the header parses, the tensors read back.
    const std::string path = TempPath("shifted.safetensors");
    {
      std::ofstream f(path, std::ios::binary);
      const uint64_t n = shifted.size();
      f.write(reinterpret_cast<const char*>(&n), 8);
      f << shifted << std::string(320, '\x02');
    }
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    auto t = (*f)->Get("a.suh");
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 16, 8u);  // mappings are page-aligned
    std::remove(path.c_str());
  }
}

struct BadCase {
  const char* name;
  std::string header;
  size_t data_bytes;
  const char* expect;  // a fragment of the message
};

TEST(Safetensors, RejectsCorruptHeadersWithAClearMessage) {
  const BadCase cases[] = {
      {"notjson", "{not json", 0, "not a JSON object"},
      {"baddtype", R"({"t":{"dtype":"F17","shape":[2],"data_offsets":[0,4]}})", 4, "unknown dtype"},
      {"outside", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "outside"},
      {"size", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "need"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, "overlaps"},
      {"hole", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "hole"},
      {"negshape", R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, "negative"},
      {"offsets", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4, "data_offsets"},
  };
  for (const auto& c : cases) {
    const std::string path = TempPath(std::string(c.name) + ".safetensors");
    WriteRaw(path, c.header, c.data_bytes);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.name;
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << f.status();
    EXPECT_NE(f.status().message().find(path), std::string::npos) << "message names the file";
    std::remove(path.c_str());
  }
}

TEST(Safetensors, RejectsTruncatedFiles) {
  SafetensorsWriter w;
  std::vector<float> a(100, 1.0f);
  w.AddF32("a", {100}, a.data());
  const std::string path = TempPath("trunc.safetensors");
  ASSERT_TRUE(w.Write(path).ok());
  const auto full = std::filesystem::file_size(path);
  for (uintmax_t size : {uintmax_t{0}, uintmax_t{5}, uintmax_t{20}, full - 1}) {
    std::filesystem::resize_file(path, size);
    auto f = SafetensorsFile::Open(path);
    EXPECT_FALSE(f.ok()) << "size " << size;
  }
  std::remove(path.c_str());
}

// Issue 28: with kOwned, a tensor handed out stays readable after its file is truncated (a
// mapped page past the new end would be SIGBUS), and Locate names the bytes without reading them.
TEST(TensorSource, OwnedTensorsOutliveTheirFile) {
  SafetensorsWriter w;
  std::vector<float> a(3000), b(5000);  // several pages, tensors sharing a page between them
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  w.AddF32("a", {3000}, a.data());
  w.AddF32("b", {5000}, b.data());
  const std::string path = TempPath("owned.safetensors");
  ASSERT_TRUE(w.Write(path).ok());
  auto src = TensorSource::Open(path, TensorResidency::kOwned);
  ASSERT_TRUE(src.ok()) << src.status();
  auto ta = (*src)->Get("a");
  auto tb = (*src)->Get("b");
  ASSERT_TRUE(ta.ok() && tb.ok());
  auto lb = (*src)->Locate("b");
  ASSERT_TRUE(lb.ok()) << lb.status();
  EXPECT_EQ(lb->file, path);
  EXPECT_EQ(lb->offset + lb->info->size_bytes(), std::filesystem::file_size(path));
  std::filesystem::resize_file(path, 64);
  EXPECT_EQ(std::memcmp(ta->data, a.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(tb->data, b.data(), b.size() * sizeof(float)), 0);
  std::remove(path.c_str());
}

TEST(TensorSource, ReadsShardedModelsThroughTheIndex) {
  const auto dir = std::filesystem::temp_directory_path() / "exl3_st_sharded";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  float v = 2.0f;
  SafetensorsWriter s1, s2;
  s1.AddF32("x", {1}, &v);
  s2.AddF32("y", {1}, &v);
  ASSERT_TRUE(s1.Write((dir / "model-00001-of-00002.safetensors").string()).ok());
  ASSERT_TRUE(s2.Write((dir / "model-00002-of-00002.safetensors").string()).ok());
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"x":"model-00001-of-00002.safetensors","y":"model-00002-of-00002.safetensors"}})";
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_TRUE((*src)->Has("y"));
  auto y = (*src)->Get("y");
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(*y->as<float>(), 2.0f);
  EXPECT_EQ((*src)->Names().size(), 2u);

  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"x":"model-00003-of-00002.safetensors"}})";
  auto bad = TensorSource::Open(dir.string());
  EXPECT_FALSE(bad.ok());
  std::filesystem::remove_all(dir);
}

// A checkpoint in DeepSeek's release naming (DeepSeek-V4 as exllamav3 writes it) is served under
// the project's names; each tensor still reads the bytes stored under its own name.
TEST(TensorSource, ServesDeepseekReleaseNamesUnderTheProjectNames) {
  const auto dir = std::filesystem::temp_directory_path() / "exl3_st_release";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  SafetensorsWriter w;
  const float embed = 1, norm = 2, fn = 3, head = 4, layer = 5, mtp = 6;
  w.AddF32("embed.weight", {1}, &embed);
  w.AddF32("norm.weight", {1}, &norm);
  w.AddF32("hc_head_fn", {1}, &fn);
  w.AddF32("head.weight", {1}, &head);
  w.AddF32("layers.0.ffn.experts.0.w1.weight", {1}, &layer);
  w.AddF32("mtp.0.attn.wkv.weight", {1}, &mtp);
  ASSERT_TRUE(w.Write((dir / "model.safetensors").string()).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ((*src)->naming(), CheckpointNaming::kDeepseekRelease);
  EXPECT_EQ((*src)->Names(),
            (std::vector<std::string>{"head.weight", "model.embed_tokens.weight",
                                      "model.hc_head.hc_fn", "model.layers.0.ffn.experts.0.w1.weight",
                                      "model.norm.weight", "mtp.0.attn.wkv.weight"}));
  const std::pair<const char*, float> want[] = {{"model.embed_tokens.weight", embed},
                                                {"model.norm.weight", norm},
                                                {"model.hc_head.hc_fn", fn},
                                                {"head.weight", head},
                                                {"model.layers.0.ffn.experts.0.w1.weight", layer},
                                                {"mtp.0.attn.wkv.weight", mtp}};
  for (const auto& [name, value] : want) {
    auto t = (*src)->Get(name);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_EQ(*t->as<float>(), value) << name;
    auto info = (*src)->Info(name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ((*info)->name, (*src)->StoredName(name));
  }
  EXPECT_EQ((*src)->StoredName("model.layers.0.ffn.experts.0.w1.weight"),
            "layers.0.ffn.experts.0.w1.weight");
  EXPECT_FALSE((*src)->Has("embed.weight"));  // one name per tensor: the project's

  // A transformers-named checkpoint is left alone.
  SafetensorsWriter t;
  t.AddF32("model.embed_tokens.weight", {1}, &embed);
  t.AddF32("model.layers.0.mlp.gate.weight", {1}, &layer);
  std::filesystem::remove(dir / "model.safetensors");
  ASSERT_TRUE(t.Write((dir / "model.safetensors").string()).ok());
  auto plain = TensorSource::Open(dir.string());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->naming(), CheckpointNaming::kTransformers);
  EXPECT_TRUE((*plain)->Has("model.layers.0.mlp.gate.weight"));
  std::filesystem::remove_all(dir);
}

// Asking for a dense weight that is stored another way says how it is stored.
TEST(TensorSource, MissingWeightNamesHowTheLayerIsStored) {
  const auto dir = std::filesystem::temp_directory_path() / "exl3_st_hint";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  SafetensorsWriter w;
  const int16_t bits[2] = {1, 2};
  w.Add("model.embed_tokens.trellis", DType::kI16, {1, 2}, bits, 4);
  w.Add("model.embed_tokens.signs", DType::kI16, {1, 2}, bits, 4);
  w.Add("lm_head.trellis", DType::kI16, {1, 2}, bits, 4);
  w.Add("model.layers.0.attn.wo_a.slice.0.trellis", DType::kI16, {1, 2}, bits, 4);
  ASSERT_TRUE(w.Write((dir / "model.safetensors").string()).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  auto embed = (*src)->Get("model.embed_tokens.weight");
  ASSERT_FALSE(embed.ok());
  EXPECT_NE(embed.status().message().find("exllamav3 quantized embedding table"), std::string::npos)
      << embed.status();
  auto head = (*src)->Get("lm_head.weight");
  ASSERT_FALSE(head.ok());
  EXPECT_NE(head.status().message().find("'lm_head' is stored as an EXL3 layer"), std::string::npos)
      << head.status();
  auto slices = (*src)->Get("model.layers.0.attn.wo_a.weight");
  ASSERT_FALSE(slices.ok());
  EXPECT_NE(slices.status().message().find("is stored as per-group slices "
                                           "('model.layers.0.attn.wo_a.slice.0', ...: exllamav3's "
                                           "DeepSeek-V4 wo_a; engine/cpu/attention/dsv4_grouped_wo_a.h reads "
                                           "those as one layer)"),
            std::string::npos) << slices.status();
  auto other = (*src)->Get("model.norm.weight");
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().message(), "tensor 'model.norm.weight' is not in the model");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace exl3
