// The CPU decoder against exllamav3's own CUDA decode (tests/golden; docs/format.md, "Golden vectors").
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/exl3_linear.h"
#include "model/safetensors.h"

namespace exl3 {
namespace {

double RelErr(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, EveryBitWidthAndCodebook) {
  const std::string path = "tests/golden/" + GetParam();
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  double worst_w = 0, worst_y = 0, worst_fwd = 0;
  int entries = 0;
  for (int K = 1; K <= 8; ++K) {
    for (int cb = 0; cb < 3; ++cb) {
      const std::string p = "K" + std::to_string(K) + "_cb" + std::to_string(cb);
      SCOPED_TRACE(p);
      auto trellis = (*file)->Get(p + ".trellis");
      auto suh = (*file)->Get(p + ".suh");
      auto svh = (*file)->Get(p + ".svh");
      auto inner = (*file)->Get(p + ".weight_inner");
      auto weight = (*file)->Get(p + ".weight");
      auto x = (*file)->Get(p + ".x");
      auto y = (*file)->Get(p + ".y");
      ASSERT_TRUE(trellis.ok() && suh.ok() && svh.ok() && inner.ok() && weight.ok() && x.ok() && y.ok());
      EXPECT_EQ((*file)->Find(p + ".mcg") != nullptr, cb == 1);
      EXPECT_EQ((*file)->Find(p + ".mul1") != nullptr, cb == 2);
      Exl3LinearView w;
      w.in_features = static_cast<int>(inner->info->shape[0]);
      w.out_features = static_cast<int>(inner->info->shape[1]);
      w.bits = static_cast<int>(trellis->info->shape[2] / 16);
      ASSERT_EQ(w.bits, K);
      w.codebook = static_cast<Codebook>(cb);
      w.trellis = trellis->as<uint16_t>();
      w.suh = suh->as<uint16_t>();
      w.svh = svh->as<uint16_t>();
      ASSERT_TRUE(ValidateLinear(w).ok());

      const size_t kn = static_cast<size_t>(w.in_features) * w.out_features;
      std::vector<uint16_t> decoded(kn);
      DequantizeInner(w, decoded.data());
      size_t mismatches = 0;
      for (size_t i = 0; i < kn; ++i) mismatches += decoded[i] != inner->as<uint16_t>()[i];
      EXPECT_EQ(mismatches, 0u) << "weight_inner must match bit for bit";

      std::vector<float> dense(kn);
      DequantizeDense(w, dense.data());
      auto ref_w = ToFloat32(*weight);
      const double ew = RelErr(dense, *ref_w);
      EXPECT_LT(ew, 1e-6);
      worst_w = std::max(worst_w, ew);

      auto xs = ToFloat32(*x);
      auto ref_y = ToFloat32(*y);
      const int T = static_cast<int>(x->info->shape[0]);
      std::vector<float> out(static_cast<size_t>(T) * w.out_features);
      LinearForwardReference(w, xs->data(), T, out.data());
      const double ey = RelErr(out, *ref_y);
      EXPECT_LT(ey, 1e-5);
      worst_fwd = std::max(worst_fwd, ey);
      ++entries;
    }
  }
  std::printf("[golden] %s: %d entries, worst |W-ref|/|ref| = %.3e, worst |y-ref|/|ref| = %.3e\n",
              GetParam().c_str(), entries, worst_w, worst_fwd);
  (void)worst_y;
}

INSTANTIATE_TEST_SUITE_P(Files, GoldenTest,
                         ::testing::Values("exl3_reference_k128_n256.safetensors",
                                           "exl3_reference_k256_n384.safetensors"));

}  // namespace
}  // namespace exl3
