// Runs the exl3-tool binary (inspect, dequant, linear, moe) on the golden files and on a model
// directory written by the test, and compares its outputs with the library.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "kernels/exl3_linear.h"
#include "kernels/moe_cpu.h"
#include "model/exl3_model.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "tests/kernels/random_layer.h"
#include "tools/test_model/expert_test_model.h"

#ifndef EXL3_TOOL_BINARY
#error "EXL3_TOOL_BINARY must name the exl3-tool binary"
#endif

namespace exl3 {
namespace {

const char kGolden[] = "tests/golden/exl3_reference_k256_n384.safetensors";

class ToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("exl3_tool_test_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Runs exl3-tool with `args`; returns the exit status, stdout and stderr in out/err.
  int Tool(const std::string& args, std::string* out = nullptr, std::string* err = nullptr) {
    const std::string o = dir_ + "/stdout", e = dir_ + "/stderr";
    const std::string cmd = std::string(EXL3_TOOL_BINARY) + " " + args + " >" + o + " 2>" + e;
    const int rc = std::system(cmd.c_str());
    if (out) *out = Slurp(o);
    if (err) *err = Slurp(e);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  static std::string Slurp(const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::vector<float> ReadF32(const std::string& path, const std::string& name, std::vector<int64_t>* shape) {
    auto f = SafetensorsFile::Open(path);
    EXPECT_TRUE(f.ok()) << f.status();
    auto t = (*f)->Get(name);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->info->dtype, DType::kF32);
    *shape = t->info->shape;
    return *ToFloat32(*t);
  }
  std::string dir_;
};

TEST_F(ToolTest, HelpEverywhere) {
  for (const char* sub : {"inspect", "dequant", "linear", "moe"}) {
    std::string out;
    EXPECT_EQ(Tool(std::string(sub) + " --help", &out), 0) << sub;
    EXPECT_NE(out.find(std::string("exl3-tool ") + sub), std::string::npos) << out;
  }
}

TEST_F(ToolTest, DequantGolden) {
  auto golden = SafetensorsFile::Open(kGolden);
  ASSERT_TRUE(golden.ok());
  for (const char* prefix : {"K1_cb0", "K3_cb1", "K8_cb2"}) {
    SCOPED_TRACE(prefix);
    const std::string out = dir_ + "/w.safetensors";
    ASSERT_EQ(Tool(std::string("dequant --input ") + kGolden + " --prefix " + prefix + " --output " + out), 0);
    std::vector<int64_t> shape;
    const auto w = ReadF32(out, "weight", &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{256, 384}));
    const auto ref = *ToFloat32(*(*golden)->Get(std::string(prefix) + ".weight"));
    EXPECT_LT(testing::RelErr(w.data(), ref.data(), ref.size()), 1e-6);

    const std::string inner = dir_ + "/wi.safetensors";
    ASSERT_EQ(Tool(std::string("dequant --inner --input ") + kGolden + " --prefix " + prefix + " --output " + inner), 0);
    auto f = SafetensorsFile::Open(inner);
    ASSERT_TRUE(f.ok());
    auto t = (*f)->Get("weight_inner");
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->info->dtype, DType::kF16);
    auto gi = (*golden)->Get(std::string(prefix) + ".weight_inner");
    ASSERT_EQ(t->size_bytes(), gi->size_bytes());
    EXPECT_EQ(std::memcmp(t->data, gi->data, gi->size_bytes()), 0) << "weight_inner bit for bit";
  }
}

TEST_F(ToolTest, LinearGoldenAllInputDtypes) {
  auto golden = SafetensorsFile::Open(kGolden);
  ASSERT_TRUE(golden.ok());
  const std::string prefix = "K4_cb1";
  auto x = (*golden)->Get(prefix + ".x");  // fp16 [4, 256]
  ASSERT_TRUE(x.ok());
  const auto yref = *ToFloat32(*(*golden)->Get(prefix + ".y"));
  const auto xf = *ToFloat32(*x);
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    SafetensorsWriter w;
    if (dt == DType::kF16) {
      w.Add("x", DType::kF16, {4, 256}, x->data, x->size_bytes());
    } else if (dt == DType::kBF16) {
      std::vector<uint16_t> b(xf.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = FloatToBFloat16Bits(xf[i]);
      w.Add("x", DType::kBF16, {4, 256}, b.data(), b.size() * 2);
    } else {
      w.AddF32("x", {4, 256}, xf.data());
    }
    const std::string xp = dir_ + "/x.safetensors", out = dir_ + "/y.safetensors";
    ASSERT_TRUE(w.Write(xp).ok());
    for (const char* backend : {"cpu", "auto"}) {
      ASSERT_EQ(Tool(std::string("linear --input ") + kGolden + " --prefix " + prefix + " --x " + xp +
                     " --output " + out + " --backend " + backend),
                0);
      std::vector<int64_t> shape;
      const auto y = ReadF32(out, "y", &shape);
      EXPECT_EQ(shape, (std::vector<int64_t>{4, 384}));
      // bf16 inputs are rounded: compare against the library on the same rounded input instead.
      std::vector<float> expect = yref;
      if (dt == DType::kBF16) {
        auto lin = *SafetensorsFile::Open(xp);
        const auto xb = *ToFloat32(*lin->Get("x"));
        auto src = TensorSource::Open(kGolden);
        auto l = LoadExl3Linear(**src, prefix);
        LinearForwardReference((*l)->view, xb.data(), 4, expect.data());
      }
      EXPECT_LT(testing::RelErr(y.data(), expect.data(), y.size()), 1e-5);
    }
  }
}

TEST_F(ToolTest, MoeAndInspectOnATestModel) {
  testing::ExpertModelSpec spec;
  spec.swiglu_limit = 4.0f;
  const std::string model = dir_ + "/model";
  ASSERT_TRUE(testing::WriteExpertModel(model, spec).ok());

  std::string out;
  ASSERT_EQ(Tool("inspect --model " + model, &out), 0);
  EXPECT_NE(out.find("Glm4MoeForCausalLM"), std::string::npos) << out;
  EXPECT_NE(out.find("MoE: 2 (1-2)"), std::string::npos) << out;
  EXPECT_NE(out.find("routed gate:      K2 mcg x6, K3 mcg x6, K4 mcg x4"), std::string::npos) << out;
  EXPECT_NE(out.find("K3 3inst x16"), std::string::npos) << out;

  const int T = 5;
  const auto x = testing::RandomVector(static_cast<size_t>(T) * 256, 11);
  SafetensorsWriter xw;
  xw.AddF32("x", {T, 256}, x.data());
  const std::string xp = dir_ + "/hx.safetensors", yp = dir_ + "/hy.safetensors";
  ASSERT_TRUE(xw.Write(xp).ok());
  ASSERT_EQ(Tool("moe --model " + model + " --layer 2 --x " + xp + " --output " + yp + " --backend cpu"), 0);

  auto m = Exl3Model::Open(model);
  ASSERT_TRUE(m.ok());
  std::vector<int32_t> ids(T * 2);
  std::vector<float> wts(T * 2), ref(T * 256);
  ASSERT_TRUE(RouteTokens((*m)->config(), 2, (*m)->RouterWeight(2), (*m)->CorrectionBias(2), x.data(), T,
                          ids.data(), wts.data()).ok());
  ASSERT_TRUE(MoeForwardReference(*(*m)->LayerView(2), x.data(),
                                  MoeAssignments::Fixed(T, 2, ids.data(), wts.data()), true, ref.data()).ok());
  auto f = SafetensorsFile::Open(yp);
  ASSERT_TRUE(f.ok());
  auto tid = (*f)->Get("topk_ids");
  ASSERT_TRUE(tid.ok());
  EXPECT_EQ(tid->info->dtype, DType::kI32);
  EXPECT_EQ(tid->info->shape, (std::vector<int64_t>{T, 2}));
  for (int i = 0; i < T * 2; ++i) EXPECT_EQ(tid->as<int32_t>()[i], ids[i]);
  std::vector<int64_t> shape;
  const auto tw = ReadF32(yp, "topk_weights", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{T, 2}));
  for (int i = 0; i < T * 2; ++i) EXPECT_FLOAT_EQ(tw[i], wts[i]);
  const auto y = ReadF32(yp, "y", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{T, 256}));
  EXPECT_LT(testing::RelErr(y.data(), ref.data(), ref.size()), 1e-5);
}

TEST_F(ToolTest, MisalignedSyntheticModelAndInspectedAlignment) {
  const std::string common = " --synthetic --arch qwen3_moe --layers 1 --hidden 256 --experts 4 --top-k 2"
                             " --intermediate 128 --bits 2 --codebook 3inst --quiet --output ";
  std::string out;
  ASSERT_EQ(Tool("make-test-model" + common + dir_ + "/aligned"), 0);
  ASSERT_EQ(Tool("inspect --model " + dir_ + "/aligned", &out), 0);
  // 4 experts x 3 projections x (trellis, suh, svh).
  EXPECT_NE(out.find("alignment:        36 of 36 expert tensors 16-byte aligned"), std::string::npos) << out;
  ASSERT_EQ(Tool("make-test-model --misaligned-data" + common + dir_ + "/misaligned"), 0);
  ASSERT_EQ(Tool("inspect --model " + dir_ + "/misaligned", &out), 0);
  EXPECT_NE(out.find("alignment:        0 of 36 expert tensors 16-byte aligned in the files (0 bytes"),
            std::string::npos) << out;
  EXPECT_NE(out.find("8-byte only 36, 4-byte only 0, less 0"), std::string::npos) << out;
  std::string err;
  EXPECT_EQ(Tool("make-test-model --misaligned-data --arch qwen3_moe --output " + dir_ + "/x", nullptr, &err), 1);
  EXPECT_NE(err.find("--misaligned-data goes with --synthetic"), std::string::npos) << err;
}

TEST_F(ToolTest, BadArgumentsAndFilesGiveOneLineAndNonZeroExit) {
  testing::ExpertModelSpec spec;
  const std::string model = dir_ + "/model";
  ASSERT_TRUE(testing::WriteExpertModel(model, spec).ok());
  const auto x = testing::RandomVector(2 * 128, 1);
  SafetensorsWriter xw;
  xw.AddF32("x", {2, 128}, x.data());  // wrong hidden size
  ASSERT_TRUE(xw.Write(dir_ + "/x.safetensors").ok());
  std::ofstream(dir_ + "/garbage.safetensors") << "not a safetensors file at all";
  const std::string cases[] = {
      "inspect",
      "inspect --model " + dir_ + "/nowhere",
      "inspect --model " + model + " --extra 1",
      "dequant --input " + std::string(kGolden) + " --prefix nope --output " + dir_ + "/o.safetensors",
      "dequant --input " + dir_ + "/garbage.safetensors --prefix K1_cb0 --output " + dir_ + "/o.safetensors",
      "linear --input " + std::string(kGolden) + " --prefix K1_cb0 --x " + dir_ + "/x.safetensors --output " +
          dir_ + "/o.safetensors",
      "linear --input " + std::string(kGolden) + " --prefix K1_cb0 --x " + dir_ + "/x.safetensors --output " +
          dir_ + "/o.safetensors --backend tpu",
      "moe --model " + model + " --layer 0 --x " + dir_ + "/x.safetensors --output " + dir_ + "/o.safetensors",
      "moe --model " + model + " --layer 1 --x " + dir_ + "/x.safetensors --output " + dir_ + "/o.safetensors",
      "moe --model " + model + " --layer one --x " + dir_ + "/x.safetensors --output " + dir_ + "/o.safetensors",
  };
  for (const std::string& c : cases) {
    SCOPED_TRACE(c);
    std::string out, err;
    EXPECT_NE(Tool(c, &out, &err), 0);
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    EXPECT_EQ(err.rfind("exl3-tool ", 0), 0u) << err;
  }
}

}  // namespace
}  // namespace exl3
