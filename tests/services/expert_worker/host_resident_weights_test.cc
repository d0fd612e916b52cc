// HostResidentWeights (services/expert_worker/host_resident_weights.h): which held tensors stay in
// the file mapping and which move into the realigned copy, that the copy replaces the file pages
// (they leave the process; resident memory grows by the share once), and that a model whose
// tensors are 8- or 4-byte aligned in its files computes the same MoE answers from the placed
// views, every pointer 16-byte aligned.
#include "services/expert_worker/host_resident_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moe_cpu.h"
#include "model/encoder/safetensors_stream_writer.h"
#include "model/exl3_model.h"
#include "model/safetensors.h"
#include "tools/test_model/test_model.h"

namespace exl3::worker {
namespace {

namespace fs = std::filesystem;

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the page holding `p` is mapped into this process (/proc/self/pagemap bit 63).
bool PagePresent(const void* p) {
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  uint64_t entry = 0;
  const off_t at = static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / kPage * sizeof(entry));
  const bool ok = pread(fd, &entry, sizeof(entry), at) == sizeof(entry);
  close(fd);
  return ok && (entry >> 63) != 0;
}

// A field of /proc/self/status in bytes (VmRSS, VmHWM, RssFile, ...).
uint64_t StatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtoull(line.c_str() + field.size() + 1, nullptr, 10) * 1024;
  }
  return 0;
}

// --- the placement decision --------------------------------------------------------------------

struct FakeMapping {
  // Addresses only: nothing is read.
  explicit FakeMapping(size_t bytes) : base(static_cast<uint8_t*>(std::aligned_alloc(kPage, bytes))) {}
  ~FakeMapping() { std::free(base); }
  TensorRange At(size_t offset, size_t size) const { return {base + offset, size, "", offset}; }
  uint8_t* base;
};

TEST(PlanHostPlacementTest, GroupOfAlignedTensorsStaysInPlace) {
  FakeMapping m(8 * kPage);
  // The last one crosses into the second page.
  const std::vector<TensorRange> r = {m.At(64, 1000), m.At(1072, 1920), m.At(kPage - 16, 1040)};
  const HostPlacementPlan plan = PlanHostPlacement(r, kPage);
  ASSERT_EQ(plan.groups.size(), 1u);
  EXPECT_EQ(plan.groups[0].placement, Placement::kInPlace);
  EXPECT_EQ(plan.groups[0].tensors, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(plan.groups[0].begin, reinterpret_cast<uintptr_t>(m.base));
  EXPECT_EQ(plan.groups[0].end, reinterpret_cast<uintptr_t>(m.base) + 2 * kPage);
  EXPECT_EQ(plan.in_place_bytes, 3960u);
  EXPECT_EQ(plan.copied_bytes, 0u);
  EXPECT_EQ(plan.copy_bytes, 0u);
}

TEST(PlanHostPlacementTest, OneMisalignedTensorMovesItsWholeGroup) {
  FakeMapping m(8 * kPage);
  // Two tensors sharing a page, the second 8 bytes past a 16-byte boundary: both are copied, or
  // the aligned one's page would stay resident beside the copy of the other's start.
  const std::vector<TensorRange> r = {m.At(0, kPage + 8), m.At(kPage + 8, 100)};
  const HostPlacementPlan plan = PlanHostPlacement(r, kPage);
  ASSERT_EQ(plan.groups.size(), 1u);
  EXPECT_EQ(plan.groups[0].placement, Placement::kRealignedCopy);
  EXPECT_EQ(plan.copied_bytes, kPage + 108);
  EXPECT_EQ(plan.in_place_bytes, 0u);
  EXPECT_EQ(plan.copy_offset[0], 0u);
  EXPECT_EQ(plan.copy_offset[1], (kPage + 8 + kCopyAlignment - 1) / kCopyAlignment * kCopyAlignment);
  EXPECT_EQ(plan.copy_bytes, plan.copy_offset[1] + kCopyAlignment);
}

TEST(PlanHostPlacementTest, TensorsOnSeparatePagesArePlacedApart) {
  FakeMapping m(8 * kPage);
  const std::vector<TensorRange> r = {
      m.At(2 * kPage + 8, 64),  // misaligned, page 2
      m.At(0, kPage),           // aligned, page 0 (ends where page 1 starts: shares no page)
      m.At(kPage, 16),          // aligned, page 1
      m.At(5 * kPage + 4, 12),  // 4-byte aligned, page 5
  };
  const HostPlacementPlan plan = PlanHostPlacement(r, kPage);
  ASSERT_EQ(plan.groups.size(), 4u);
  EXPECT_EQ(plan.groups[0].placement, Placement::kInPlace);
  EXPECT_EQ(plan.groups[0].tensors, std::vector<size_t>{1});
  EXPECT_EQ(plan.groups[1].placement, Placement::kInPlace);
  EXPECT_EQ(plan.groups[1].tensors, std::vector<size_t>{2});
  EXPECT_EQ(plan.groups[2].placement, Placement::kRealignedCopy);
  EXPECT_EQ(plan.groups[2].tensors, std::vector<size_t>{0});
  EXPECT_EQ(plan.groups[3].placement, Placement::kRealignedCopy);
  EXPECT_EQ(plan.in_place_bytes, kPage + 16);
  EXPECT_EQ(plan.copied_bytes, 76u);
  EXPECT_EQ(plan.copy_offset[0], 0u);
  EXPECT_EQ(plan.copy_offset[3], kCopyAlignment);
}

TEST(PlanHostPlacementTest, DuplicatesShareOneCopyAndEmptyRangesAreSkipped) {
  FakeMapping m(4 * kPage);
  const std::vector<TensorRange> r = {m.At(8, 100), m.At(8, 100), m.At(300, 0), {nullptr, 16, "", 0}};
  const HostPlacementPlan plan = PlanHostPlacement(r, kPage);
  ASSERT_EQ(plan.groups.size(), 1u);
  EXPECT_EQ(plan.groups[0].tensors.size(), 1u);
  EXPECT_EQ(plan.copied_bytes, 100u);
  EXPECT_EQ(plan.copy_offset[0], plan.copy_offset[1]);
  EXPECT_EQ(plan.copy_bytes, kCopyAlignment);
}

TEST(PlanHostPlacementTest, NothingHeldPlansNothing) {
  const HostPlacementPlan plan = PlanHostPlacement({}, kPage);
  EXPECT_TRUE(plan.groups.empty());
  EXPECT_EQ(plan.copy_bytes, 0u);
}

// --- loading from files --------------------------------------------------------------------------

// Writes a safetensors file of `n` I16 tensors of `bytes` each (multiples of 16) with contents
// from `seed`, its data section starting as `start` says, in pieces of at most 1 MiB.
std::vector<std::vector<uint8_t>> WriteFile(const std::string& path, int n, size_t bytes,
                                            DataSectionStart start, uint32_t seed, bool keep = true) {
  SafetensorsStreamWriter w;
  w.SetDataSectionStart(start);
  for (int i = 0; i < n; ++i) w.Declare("t" + std::to_string(i), DType::kI16, {static_cast<int64_t>(bytes / 2)});
  EXPECT_TRUE(w.Open(path).ok());
  std::vector<std::vector<uint8_t>> contents;
  std::mt19937 rng(seed);
  std::vector<uint8_t> piece;
  for (int i = 0; i < n; ++i) {
    if (keep) contents.emplace_back();
    for (size_t done = 0; done < bytes;) {
      piece.resize(std::min<size_t>(bytes - done, 1u << 20));
      for (uint8_t& b : piece) b = static_cast<uint8_t>(rng());
      EXPECT_TRUE(w.Write("t" + std::to_string(i), piece.data(), piece.size()).ok());
      if (keep) contents.back().insert(contents.back().end(), piece.begin(), piece.end());
      done += piece.size();
    }
  }
  EXPECT_TRUE(w.Finish().ok());
  return contents;
}

std::vector<TensorRange> RangesOf(const SafetensorsFile& f, int n, const std::string& path) {
  uint64_t header_len = 0;
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&header_len), 8);
  std::vector<TensorRange> r;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<TensorView> v = f.Get("t" + std::to_string(i));
    EXPECT_TRUE(v.ok()) << v.status();
    r.push_back({v->data, v->size_bytes(), path, 8 + header_len + v->info->begin});
  }
  return r;
}

TEST(HostResidentWeightsTest, CopyReplacesMisalignedFilePagesAndAlignedOnesStayInPlace) {
  const fs::path dir = fs::temp_directory_path() / ("exl3_host_weights_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string misaligned = (dir / "misaligned.safetensors").string();
  const std::string aligned = (dir / "aligned.safetensors").string();
  const auto mis_contents = WriteFile(misaligned, 6, 48 * 1024 + 16, DataSectionStart::k8PastA16ByteBoundary, 1);
  const auto al_contents = WriteFile(aligned, 3, 64 * 1024, DataSectionStart::k64ByteAligned, 2);
  auto mf = SafetensorsFile::Open(misaligned);
  auto af = SafetensorsFile::Open(aligned);
  ASSERT_TRUE(mf.ok() && af.ok());
  std::vector<TensorRange> ranges = RangesOf(**mf, 6, misaligned);
  for (const TensorRange& r : ranges) ASSERT_EQ(reinterpret_cast<uintptr_t>(r.data) % 16, 8u);
  const std::vector<TensorRange> al = RangesOf(**af, 3, aligned);
  for (const TensorRange& r : al) ASSERT_TRUE(Aligned16(r.data));
  ranges.insert(ranges.end(), al.begin(), al.end());

  HostLoadOptions o;
  o.threads = 2;
  o.chunk_bytes = 16 * 1024;
  absl::StatusOr<std::unique_ptr<HostResidentWeights>> w = HostResidentWeights::Load(ranges, o);
  ASSERT_TRUE(w.ok()) << w.status();
  const HostLoadStats& st = (*w)->stats();
  EXPECT_EQ(st.copied_bytes, 6u * (48 * 1024 + 16));
  EXPECT_EQ(st.in_place_bytes, 3u * 64 * 1024);
  EXPECT_EQ(st.bytes, st.copied_bytes + st.in_place_bytes);
  EXPECT_GE(st.dropped_bytes, st.copied_bytes);
  ASSERT_NE((*w)->copy_data(), nullptr);

  // Copied tensors' file pages left the process (checked before anything reads them again).
  for (int i = 0; i < 6; ++i) {
    for (size_t o = 0; o < ranges[i].size; o += kPage) {
      EXPECT_FALSE(PagePresent(ranges[i].data + o)) << "tensor " << i << " page at +" << o;
    }
  }
  for (int i = 6; i < 9; ++i) {
    for (size_t o = 0; o < ranges[i].size; o += kPage) EXPECT_TRUE(PagePresent(ranges[i].data + o));
  }
  for (int i = 0; i < 9; ++i) {
    const void* p = (*w)->Resolve(static_cast<const void*>(ranges[i].data));
    EXPECT_TRUE(Aligned16(p)) << i;
    const std::vector<uint8_t>& want = i < 6 ? mis_contents[i] : al_contents[i - 6];
    EXPECT_EQ(std::memcmp(p, want.data(), want.size()), 0) << i;
    if (i < 6) {
      EXPECT_NE(p, static_cast<const void*>(ranges[i].data));
      // A pointer into a copied tensor resolves to the same byte of its copy.
      EXPECT_EQ((*w)->Resolve(static_cast<const void*>(ranges[i].data + 100)), static_cast<const uint8_t*>(p) + 100);
    } else {
      EXPECT_EQ(p, static_cast<const void*>(ranges[i].data));
    }
  }
  // Outside every held tensor: unchanged.
  int local = 0;
  EXPECT_EQ((*w)->Resolve(static_cast<const void*>(&local)), static_cast<const void*>(&local));
  EXPECT_EQ((*w)->Resolve(static_cast<const void*>(nullptr)), nullptr);
  w->reset();
  mf->reset();
  af->reset();
  fs::remove_all(dir);
}

TEST(HostResidentWeightsTest, PeakResidentMemoryIsTheShareOnce) {
  // /proc/self/clear_refs "5" resets VmHWM to the current resident size (Linux 4.0).
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    if (!clear) GTEST_SKIP() << "cannot reset VmHWM here (/proc/self/clear_refs not writable)";
  }
  const fs::path dir = fs::temp_directory_path() / ("exl3_host_weights_peak_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "share.safetensors").string();
  constexpr int kTensors = 24;
  constexpr size_t kBytes = 4u << 20;  // 96 MiB, 8 bytes past 16-byte boundaries
  WriteFile(path, kTensors, kBytes, DataSectionStart::k8PastA16ByteBoundary, 3, /*keep=*/false);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  const std::vector<TensorRange> ranges = RangesOf(**f, kTensors, path);
  const uint64_t share = kTensors * kBytes;

  std::ofstream("/proc/self/clear_refs") << "5";
  const uint64_t before = StatusBytes("VmRSS");
  HostLoadOptions o;
  o.threads = 2;
  o.chunk_bytes = 1u << 20;
  absl::StatusOr<std::unique_ptr<HostResidentWeights>> w = HostResidentWeights::Load(ranges, o);
  ASSERT_TRUE(w.ok()) << w.status();
  const uint64_t peak = StatusBytes("VmHWM") - before;
  const uint64_t after = StatusBytes("VmRSS") - before;
  std::printf("share %.1f MB: peak resident growth %.3f x share, after the load %.3f x share\n", share / 1e6,
              static_cast<double>(peak) / share, static_cast<double>(after) / share);
  EXPECT_EQ((*w)->stats().copied_bytes, share);
  EXPECT_LE(peak, share * 11 / 10) << "peak " << peak << " bytes for a share of " << share;
  EXPECT_GE(after, share * 95 / 100);  // the copy is resident
  EXPECT_LE(after, share * 105 / 100) << "the file pages stayed resident beside the copy";
  w->reset();
  f->reset();
  fs::remove_all(dir);
}

// --- a model whose tensors the files leave 8- or 4-byte aligned ------------------------------------

struct ModelCase {
  const char* name;
  Codebook codebook;
  DataSectionStart start;
  bool expect_copies;
};

class HostResidentModelTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(HostResidentModelTest, PlacedViewsAreAlignedAndComputeTheSameAnswers) {
  const ModelCase& mc = GetParam();
  TestModelSpec spec;
  spec.arch = "glm4_moe";  // with a shared expert
  spec.layers = 2;
  spec.dense_layers = 1;
  spec.hidden = 256;
  spec.experts = 8;
  spec.top_k = 2;
  spec.intermediate = 128;
  SyntheticOptions so;
  so.bits = 2;
  so.codebook = mc.codebook;
  so.data_start = mc.start;
  so.progress = false;
  const fs::path dir = fs::temp_directory_path() / (std::string("exl3_host_model_") + mc.name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  ASSERT_TRUE(WriteSyntheticExl3Model(spec, so, dir.string()).ok());
  Exl3ModelOptions mo;
  mo.experts = std::map<int, std::vector<int>>{{1, {0, 2, 3, 5, 7}}};
  auto model = Exl3Model::Open(dir.string(), mo);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<TensorRange> ranges = HeldTensorRanges(**model, /*shared=*/true);
  ASSERT_FALSE(ranges.empty());
  size_t misaligned = 0;
  for (const TensorRange& r : ranges) misaligned += Aligned16(r.data) ? 0 : 1;
  if (mc.expect_copies) {
    EXPECT_GT(misaligned, ranges.size() / 2) << "the premise: the files leave most tensors misaligned";
  } else {
    EXPECT_EQ(misaligned, 0u);
  }

  absl::StatusOr<MoeLayerView> view = (*model)->LayerView(1);
  ASSERT_TRUE(view.ok());
  // Reference answers from the file mapping before placing (afterwards those pages may be gone
  // from the process; reading them again would only fault them back in).
  const int T = 5;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(T) * spec.hidden);
  for (float& v : x) v = nd(rng);
  const std::vector<int32_t> ids = {0, 2, 3, 5, 7, 0, 2, 7, 5, 3};
  const std::vector<float> wts = {0.5f, 0.25f, 1.0f, 0.75f, 0.1f, 0.9f, 0.3f, 0.6f, 0.2f, 0.8f};
  const MoeAssignments a = MoeAssignments::Fixed(T, 2, ids.data(), wts.data());
  std::vector<float> want(x.size()), got(x.size());
  ASSERT_TRUE(MoeForwardReference(*view, x.data(), a, /*include_shared=*/true, want.data()).ok());

  HostLoadOptions o;
  o.threads = 2;
  o.chunk_bytes = 8 * 1024;
  absl::StatusOr<std::unique_ptr<HostResidentWeights>> w = HostResidentWeights::Load(ranges, o);
  ASSERT_TRUE(w.ok()) << w.status();
  if (mc.expect_copies) {
    EXPECT_GT((*w)->stats().copied_bytes, (*w)->stats().bytes / 2);
  } else {
    EXPECT_EQ((*w)->stats().copied_bytes, 0u);
    EXPECT_EQ((*w)->stats().in_place_bytes, (*w)->stats().bytes);
  }
  std::unique_ptr<PlacedMoeLayer> placed = (*w)->Place(*view);
  const MoeLayerView& pv = placed->view();
  ASSERT_EQ(pv.experts.size(), view->experts.size());
  auto check_linear = [&](const Exl3LinearView& l) {
    EXPECT_TRUE(Aligned16(l.trellis));
    EXPECT_TRUE(Aligned16(l.suh));
    EXPECT_TRUE(Aligned16(l.svh));
    if (l.bias) {
      EXPECT_TRUE(Aligned16(l.bias));
    }
  };
  for (size_t e = 0; e < pv.experts.size(); ++e) {
    ASSERT_EQ(pv.experts[e] == nullptr, view->experts[e] == nullptr) << e;
    if (pv.experts[e] == nullptr) continue;
    check_linear(pv.experts[e]->gate);
    check_linear(pv.experts[e]->up);
    check_linear(pv.experts[e]->down);
  }
  ASSERT_NE(pv.shared, nullptr);
  check_linear(pv.shared->gate);
  check_linear(pv.shared->up);
  check_linear(pv.shared->down);
  ASSERT_TRUE(MoeForwardReference(pv, x.data(), a, /*include_shared=*/true, got.data()).ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  placed.reset();
  w->reset();
  model->reset();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, HostResidentModelTest,
    ::testing::Values(
        // Every tensor 8 bytes past a 16-byte boundary (as Python's safetensors leaves them).
        ModelCase{"threeinst_8_past_16", Codebook::k3Inst, DataSectionStart::k8PastA16ByteBoundary, true},
        // 4-byte mcg flags between the tensors: 4-, 8- and 12-byte offsets mixed.
        ModelCase{"mcg_8_past_16", Codebook::kMcg, DataSectionStart::k8PastA16ByteBoundary, true},
        // Every EXL3 tensor 16-byte aligned: all read in place, nothing copied.
        ModelCase{"threeinst_aligned", Codebook::k3Inst, DataSectionStart::k64ByteAligned, false}),
    [](const ::testing::TestParamInfo<ModelCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace exl3::worker
