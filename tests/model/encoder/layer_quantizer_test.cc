// The layer quantizer: a layer written by it reads back through the decoder (DequantizeDense)
// with the relative error that its tile MSE predicts, and its tensors have the format's shapes.
#include "model/encoder/layer_quantizer.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "tests/model/encoder/relative_error.h"

namespace exl3 {
namespace {

// [out, in] Gaussian weight; with `uneven`, rows and columns get separable magnitudes spanning
// two orders (as real layers have) so that the channel scales matter.
std::vector<float> RandomWeight(int out, int in, bool uneven, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  std::vector<float> ro(out, 1.0f), ci(in, 1.0f);
  if (uneven) {
    for (float& v : ro) v = std::pow(10.0f, ud(rng));
    for (float& v : ci) v = std::pow(10.0f, ud(rng));
  }
  std::vector<float> w(static_cast<size_t>(out) * in);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i) w[static_cast<size_t>(o) * in + i] = nd(rng) * ro[o] * ci[i];
  return w;
}

double RelativeError(const std::vector<float>& w_hf, const QuantizedLayer& q) {
  return ::exl3::testing::DequantRelativeError(q.view(), w_hf);
}

struct Case {
  int bits;
  Codebook cb;
  bool uneven;
};

class LayerQuantizerError : public ::testing::TestWithParam<Case> {};

TEST_P(LayerQuantizerError, MatchesTilePrediction) {
  const Case c = GetParam();
  const int out = 256, in = 128;
  const std::vector<float> w = RandomWeight(out, in, c.uneven, 7 + c.bits);
  LayerQuantOptions opts;
  opts.bits = c.bits;
  opts.codebook = c.cb;
  opts.seed = 42;
  opts.threads = 2;
  absl::StatusOr<QuantizedLayer> q = QuantizeLinear(w.data(), out, in, opts);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE(ValidateLinear(q->view()).ok());
  EXPECT_EQ(q->trellis.size(), static_cast<size_t>(in / 16) * (out / 16) * 16 * c.bits);
  const double rel = RelativeError(w, *q);
  // The prediction: the tile MSE at unit scale, close to the Gaussian table's value.
  const double bound = std::pow(4.0, -c.bits);
  // (At high K the few values clipped by the codebook's range dominate, and vary with the
  // sample: 128 tiles here.)
  EXPECT_LT(q->relative_mse, (c.bits >= 5 ? 2.0 : 1.4) * bound);
  EXPECT_GT(q->relative_mse, 0.95 * bound);
  // Read back through the decoder: same error up to fp16 storage of W_inner's codebook values
  // and the channel scales' interplay with the quantization noise.
  EXPECT_NEAR(rel / q->relative_mse, 1.0, 0.12)
      << "K=" << c.bits << " cb=" << CodebookName(c.cb) << " uneven=" << c.uneven
      << " rel=" << rel << " predicted=" << q->relative_mse;
}

INSTANTIATE_TEST_SUITE_P(
    Layers, LayerQuantizerError,
    ::testing::Values(Case{2, Codebook::kMcg, false}, Case{2, Codebook::kMcg, true},
                      Case{3, Codebook::k3Inst, true}, Case{4, Codebook::kMul1, false},
                      Case{4, Codebook::kMcg, true}, Case{6, Codebook::k3Inst, false}));

TEST(LayerQuantizer, SeedsAreDeterministicAndFlagsWritten) {
  const std::vector<float> w = RandomWeight(128, 128, false, 3);
  LayerQuantOptions opts;
  opts.bits = 3;
  opts.codebook = Codebook::kMcg;
  opts.seed = 9;
  opts.threads = 1;
  auto a = QuantizeLinear(w.data(), 128, 128, opts);
  auto b = QuantizeLinear(w.data(), 128, 128, opts);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->trellis, b->trellis);
  EXPECT_EQ(a->suh, b->suh);
  EXPECT_EQ(a->svh, b->svh);

  SafetensorsWriter writer;
  AddQuantizedLayer(*a, "layer", &writer);
  const std::string path = ::testing::TempDir() + "/layer_quantizer_test.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto mcg = (*file)->Get("layer.mcg");
  ASSERT_TRUE(mcg.ok());
  EXPECT_TRUE(mcg->info->shape.empty());
  EXPECT_EQ(static_cast<uint32_t>(*mcg->as<int32_t>()), 0xCBAC1FEDu);
  auto trellis = (*file)->Get("layer.trellis");
  ASSERT_TRUE(trellis.ok());
  EXPECT_EQ(trellis->info->shape, (std::vector<int64_t>{8, 8, 48}));
  EXPECT_EQ(trellis->info->dtype, DType::kI16);
  std::remove(path.c_str());
}

TEST(LayerQuantizer, RefusesBadShapesAndValues) {
  std::vector<float> w(100 * 128, 0.01f);
  LayerQuantOptions opts;
  EXPECT_FALSE(QuantizeLinear(w.data(), 100, 128, opts).ok());
  std::vector<float> v(128 * 128, 0.01f);
  v[77] = std::nanf("");
  EXPECT_FALSE(QuantizeLinear(v.data(), 128, 128, opts).ok());
  opts.bits = 9;
  v[77] = 0;
  EXPECT_FALSE(QuantizeLinear(v.data(), 128, 128, opts).ok());
}

}  // namespace
}  // namespace exl3
