// End to end through the exl3-tool binary: quantize-tensor, make-test-model (HF + conversion for
// every family, --synthetic), quantize (restart, refusals), and `exl3-tool moe` on a converted
// test model against the same layer computed in fp32 from the original HF weights.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "model/checkpoint_naming.h"
#include "model/config/read_moe_config.h"
#include "model/exl3_linear_loader.h"
#include "model/exl3_model.h"
#include "model/moe_config.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/model/encoder/relative_error.h"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using ::exl3::testing::DequantRelativeError;

// A fresh directory per test process (other builds' ctest runs may share /tmp), removed at exit.
std::string TempDir(const std::string& name) {
  const fs::path p = fs::path(::testing::TempDir()) /
                     ("encoder_tools_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  static std::vector<fs::path> made;
  static const bool registered = [] {
    std::atexit([] {
      std::error_code ec;
      for (const fs::path& d : made) fs::remove_all(d, ec);
    });
    return true;
  }();
  (void)registered;
  made.push_back(p);
  return p.string();
}

// Runs exl3-tool with `args`; returns the exit status, stderr in *err.
int Tool(const std::string& args, std::string* err = nullptr) {
  // One file per test process and call: ctest runs the tests of this binary in parallel.
  static int calls = 0;
  const std::string errfile = ::testing::TempDir() + "/encoder_tools_stderr_" +
                              std::to_string(getpid()) + "_" + std::to_string(calls++) + ".txt";
  const std::string cmd = std::string(EXL3_TOOL_BINARY) + " " + args + " 2> " + errfile +
                          " > /dev/null";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(errfile);
  std::stringstream ss;
  ss << in.rdbuf();
  if (err) *err = ss.str();
  std::remove(errfile.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::vector<float> Load(const TensorSource& src, const std::string& name) {
  absl::StatusOr<TensorView> t = src.Get(name);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return {};
  absl::StatusOr<std::vector<float>> f = ToFloat32(*t);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : std::vector<float>{};
}

// y[o] = sum_i w[o, i] x[i] (HF orientation [out, in]).
std::vector<double> MatVec(const std::vector<float>& w, const std::vector<double>& x, int out) {
  const int in = static_cast<int>(x.size());
  std::vector<double> y(out, 0.0);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i) y[o] += static_cast<double>(w[static_cast<size_t>(o) * in + i]) * x[i];
  return y;
}

// down(silu(gate x) * up x) in double from HF-orientation weights.
std::vector<double> Mlp(const std::vector<float>& g, const std::vector<float>& u,
                        const std::vector<float>& d, const std::vector<double>& x, int inter) {
  std::vector<double> a = MatVec(g, x, inter), b = MatVec(u, x, inter);
  for (int i = 0; i < inter; ++i) a[i] = a[i] / (1.0 + std::exp(-a[i])) * b[i];
  return MatVec(d, a, static_cast<int>(x.size()));
}

TEST(EncoderTools, QuantizeTensorWritesAnExl3Layer) {
  const std::string dir = TempDir("qt");
  const int out = 256, in = 128;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(out) * in);
  std::vector<uint16_t> bf(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    bf[i] = FloatToBFloat16Bits(nd(rng));
    w[i] = BFloat16BitsToFloat(bf[i]);
  }
  SafetensorsWriter sw;
  sw.Add("proj.weight", DType::kBF16, {out, in}, bf.data(), bf.size() * 2);
  ASSERT_TRUE(sw.Write(dir + "/in.safetensors").ok());
  ASSERT_EQ(Tool("quantize-tensor --input " + dir + "/in.safetensors --tensor proj.weight --output " +
                 dir + "/out.safetensors --prefix layer.proj --bits 3 --codebook mul1 --seed 5"),
            0);
  auto f = SafetensorsFile::Open(dir + "/out.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  auto trellis = (*f)->Get("layer.proj.trellis");
  auto suh = (*f)->Get("layer.proj.suh");
  auto svh = (*f)->Get("layer.proj.svh");
  auto flag = (*f)->Get("layer.proj.mul1");
  ASSERT_TRUE(trellis.ok() && suh.ok() && svh.ok() && flag.ok());
  EXPECT_EQ(trellis->info->shape, (std::vector<int64_t>{in / 16, out / 16, 48}));
  EXPECT_EQ(static_cast<uint32_t>(*flag->as<int32_t>()), 0x83DCD12Du);
  Exl3LinearView v;
  v.in_features = in;
  v.out_features = out;
  v.bits = 3;
  v.codebook = Codebook::kMul1;
  v.trellis = trellis->as<uint16_t>();
  v.suh = suh->as<uint16_t>();
  v.svh = svh->as<uint16_t>();
  const double rel = DequantRelativeError(v, w);
  EXPECT_LT(rel, 1.3 * std::pow(4.0, -3));
  EXPECT_GT(rel, 0.9 * std::pow(4.0, -3));

  std::string err;
  EXPECT_NE(Tool("quantize-tensor --input " + dir + "/in.safetensors --tensor nope --output " + dir +
                 "/x.safetensors --prefix p --bits 3", &err), 0);
  EXPECT_NE(err.find("nope"), std::string::npos) << err;
  EXPECT_NE(Tool("quantize-tensor --input " + dir + "/in.safetensors --tensor proj.weight --output " +
                 dir + "/x.safetensors --prefix p --bits 9", &err), 0);
}

// Every family: the HF checkpoint parses with the family's config, conversion produces a model
// that model/exl3_model opens with all experts.
class FamilyTest : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyTest, MakeTestModelConvertsAndOpens) {
  const std::string arch = GetParam();
  const std::string dir = TempDir("family_" + arch);
  const bool sig = arch == "glm4_moe" || arch == "deepseek_v3" || arch == "glm_moe_dsa";
  const std::string layers = sig ? "2" : "1";
  ASSERT_EQ(Tool("make-test-model --quiet --arch " + arch + " --output " + dir + "/exl3 --hidden 128 " +
                 "--intermediate 128 --experts 4 --top-k 2 --layers " + layers +
                 " --bits 2 --down-bits 3 --codebook mcg --seed 7"),
            0);
  absl::StatusOr<MoeConfig> hf = LoadMoeConfig(dir + "/exl3-hf");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_TRUE(hf->quant_method.empty());
  EXPECT_EQ(hf->has_shared_expert(), sig);
  EXPECT_EQ(hf->has_correction_bias, sig);
  EXPECT_EQ(hf->IsMoeLayer(0), !sig);  // dense first layer for GLM/DeepSeek
  auto model = Exl3Model::Open(dir + "/exl3");
  ASSERT_TRUE(model.ok()) << model.status();
  const MoeConfig& c = (*model)->config();
  EXPECT_EQ(c.quant_method, "exl3");
  EXPECT_TRUE((*model)->fingerprint_covers_weights());  // quantize recorded the digests
  const int L = sig ? 1 : 0;
  EXPECT_EQ((*model)->HeldExperts(L).size(), 4u);
  EXPECT_NE((*model)->RouterWeight(L), nullptr);
  EXPECT_EQ((*model)->CorrectionBias(L) != nullptr, sig);
  EXPECT_EQ((*model)->SharedExpert(L) != nullptr, sig);
  // Mixed widths: gate/up K=2, down K=3, MCG.
  EXPECT_EQ((*model)->tensors().Get(RoutedExpertPrefix(c, L, 2, Projection::kGate) + ".trellis")->info->shape[2], 32);
  EXPECT_EQ((*model)->tensors().Get(RoutedExpertPrefix(c, L, 2, Projection::kDown) + ".trellis")->info->shape[2], 48);
  EXPECT_TRUE((*model)->tensors().Has(RoutedExpertPrefix(c, L, 2, Projection::kDown) + ".mcg"));
  // Non-expert tensors copied unchanged.
  auto a = TensorSource::Open(dir + "/exl3-hf");
  ASSERT_TRUE(a.ok());
  for (const std::string& name : {std::string("model.embed_tokens.weight"), RouterWeightKey(c, L)}) {
    auto x = (*a)->Get(name);
    auto y = (*model)->tensors().Get(name);
    ASSERT_TRUE(x.ok() && y.ok()) << name;
    ASSERT_EQ(x->size_bytes(), y->size_bytes());
    EXPECT_EQ(0, std::memcmp(x->data, y->data, x->size_bytes())) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTest,
                         ::testing::Values("glm4_moe", "deepseek_v3", "qwen3_moe", "mixtral",
                                           "glm_moe_dsa"));

// exl3-tool moe (the serving path) on a converted GLM test model vs the fp32 layer from the HF
// weights: same routing, and an output error of the size the weights' quantization error predicts.
TEST(EncoderTools, MoeOfConvertedModelMatchesFp32Reference) {
  const std::string dir = TempDir("moe");
  const int H = 128, I = 128, E = 4, T = 6;
  ASSERT_EQ(Tool("make-test-model --quiet --arch glm4_moe --output " + dir + "/exl3 --hidden 128 "
                 "--intermediate 128 --experts 4 --top-k 2 --layers 2 --bits 4 --codebook mcg "
                 "--routed-scaling-factor 2.5 --seed 11"),
            0);
  // Hidden states.
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(T * H);
  for (float& v : x) v = nd(rng);
  SafetensorsWriter xw;
  xw.AddF32("x", {T, H}, x.data());
  ASSERT_TRUE(xw.Write(dir + "/x.safetensors").ok());
  std::string err;
  ASSERT_EQ(Tool("moe --model " + dir + "/exl3 --layer 1 --x " + dir + "/x.safetensors --output " +
                 dir + "/y.safetensors --backend cpu", &err), 0) << err;
  auto yf = SafetensorsFile::Open(dir + "/y.safetensors");
  ASSERT_TRUE(yf.ok());
  const float* y = (*yf)->Get("y")->as<float>();
  const int32_t* ids = (*yf)->Get("topk_ids")->as<int32_t>();
  const float* wts = (*yf)->Get("topk_weights")->as<float>();

  // fp32/double reference from the HF checkpoint, with the family's routing function.
  absl::StatusOr<MoeConfig> cfg = LoadMoeConfig(dir + "/exl3-hf");
  ASSERT_TRUE(cfg.ok());
  auto hf = TensorSource::Open(dir + "/exl3-hf");
  ASSERT_TRUE(hf.ok());
  const std::vector<float> router = Load(**hf, RouterWeightKey(*cfg, 1));
  const std::vector<float> bias = Load(**hf, CorrectionBiasKey(*cfg, 1));
  std::vector<int32_t> ref_ids(T * 2);
  std::vector<float> ref_w(T * 2);
  ASSERT_TRUE(RouteTokens(*cfg, 1, router.data(), bias.data(), x.data(), T, ref_ids.data(),
                          ref_w.data()).ok());
  std::vector<std::vector<float>> g(E), u(E), d(E);
  for (int e = 0; e < E; ++e) {
    g[e] = Load(**hf, RoutedExpertPrefix(*cfg, 1, e, Projection::kGate) + ".weight");
    u[e] = Load(**hf, RoutedExpertPrefix(*cfg, 1, e, Projection::kUp) + ".weight");
    d[e] = Load(**hf, RoutedExpertPrefix(*cfg, 1, e, Projection::kDown) + ".weight");
  }
  const std::vector<float> sg = Load(**hf, SharedExpertPrefix(*cfg, 1, Projection::kGate) + ".weight");
  const std::vector<float> su = Load(**hf, SharedExpertPrefix(*cfg, 1, Projection::kUp) + ".weight");
  const std::vector<float> sd = Load(**hf, SharedExpertPrefix(*cfg, 1, Projection::kDown) + ".weight");
  double num = 0, den = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    std::vector<double> ref = Mlp(sg, su, sd, xt, I);
    for (int j = 0; j < 2; ++j) {
      EXPECT_EQ(ids[t * 2 + j], ref_ids[t * 2 + j]) << "token " << t;
      EXPECT_NEAR(wts[t * 2 + j], ref_w[t * 2 + j], 1e-6);
      const int e = ref_ids[t * 2 + j];
      const std::vector<double> o = Mlp(g[e], u[e], d[e], xt, I);
      for (int i = 0; i < H; ++i) ref[i] += ref_w[t * 2 + j] * o[i];
    }
    for (int i = 0; i < H; ++i) {
      num += (y[t * H + i] - ref[i]) * (y[t * H + i] - ref[i]);
      den += ref[i] * ref[i];
    }
  }
  // Each weight carries a relative squared error of about 1.15 * 4^-4 (the tile MSE at K=4);
  // through gate/up (whose errors add in the product) and down the output's relative squared
  // error is about 3x that (independent errors add).
  const double rel = num / den;
  const double predicted = 3 * 1.15 * std::pow(4.0, -4);
  std::printf("moe output relative squared error %.3e (predicted %.3e)\n", rel, predicted);
  EXPECT_LT(rel, 2.0 * predicted) << "relative squared error " << rel;
  EXPECT_GT(rel, 0.5 * predicted) << "relative squared error " << rel;
}

TEST(EncoderTools, QuantizeRestartsAndRefusesBadInput) {
  const std::string dir = TempDir("quantize");
  ASSERT_EQ(Tool("make-test-model --quiet --arch qwen3_moe --output " + dir + "/hf --hf-only --hidden 128 "
                 "--intermediate 128 --experts 2 --top-k 1 --layers 2"),
            0);
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q --bits 2 --threads 2"), 0);
  const auto mtime = fs::last_write_time(dir + "/q/model-00001-of-00002.safetensors");
  // Lose one shard: the rerun redoes it and keeps the other.
  fs::remove(dir + "/q/model-00002-of-00002.safetensors");
  std::string err;
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q --bits 2", &err), 0);
  EXPECT_EQ(mtime, fs::last_write_time(dir + "/q/model-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/q/model-00002-of-00002.safetensors"));
  // The digests cover the redone shard: every tensor reads back (a full open checks them all).
  absl::StatusOr<std::unique_ptr<Exl3Model>> q = Exl3Model::Open(dir + "/q");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE((*q)->fingerprint_covers_weights());

  // Unsupported architecture.
  fs::create_directories(dir + "/bad");
  fs::copy(dir + "/hf/model-00001-of-00002.safetensors", dir + "/bad/");
  std::ofstream(dir + "/bad/config.json") << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 128})";
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/bad --output " + dir + "/q2 --bits 2", &err), 0);
  EXPECT_NE(err.find("LlamaForCausalLM"), std::string::npos) << err;
  // Corrupt shard (truncated).
  fs::copy(dir + "/hf/config.json", dir + "/bad/config.json", fs::copy_options::overwrite_existing);
  fs::resize_file(dir + "/bad/model-00001-of-00002.safetensors", 1000);
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/bad --output " + dir + "/q3 --bits 2", &err), 0);
  EXPECT_FALSE(err.empty());
  // Already quantized.
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/q --output " + dir + "/q4 --bits 2", &err), 0);
  EXPECT_NE(err.find("already quantized"), std::string::npos) << err;
}

nlohmann::json QuantizationConfig(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("quantization_config") ? j["quantization_config"] : nlohmann::json();
}

// ‖W − Ŵ‖² / ‖W‖² of the EXL3 layer at `prefix` of `exl3_dir` against `prefix`.weight of `hf_dir`.
double RelativeError(const std::string& hf_dir, const std::string& exl3_dir, const std::string& prefix) {
  auto hf = TensorSource::Open(hf_dir);
  auto q = TensorSource::Open(exl3_dir);
  EXPECT_TRUE(hf.ok() && q.ok());
  if (!hf.ok() || !q.ok()) return -1;
  absl::StatusOr<std::unique_ptr<Exl3Linear>> lin = LoadExl3Linear(**q, prefix);
  EXPECT_TRUE(lin.ok()) << lin.status();
  if (!lin.ok()) return -1;
  return DequantRelativeError((*lin)->view, Load(**hf, prefix + ".weight"));
}

int BitsOf(const std::string& dir, const std::string& prefix) {
  auto src = TensorSource::Open(dir);
  if (!src.ok()) return -1;
  absl::StatusOr<std::unique_ptr<Exl3Linear>> lin = LoadExl3Linear(**src, prefix);
  return lin.ok() ? (*lin)->view.bits : 0;
}

// exllamav3's default: attention, dense MLPs and the head are quantized too (head at 6 bits);
// --no-quantize-* keeps the experts-only conversion; unfit shapes stay dense; a tied head works.
TEST(EncoderTools, QuantizeCoversAttentionDenseMlpAndHead) {
  const std::string dir = TempDir("linears");
  ASSERT_EQ(Tool("make-test-model --quiet --arch glm4_moe --output " + dir + "/hf --hf-only --hidden 256 "
                 "--intermediate 128 --experts 2 --top-k 1 --layers 2 --n-group 1 --topk-group 1"),
            0);
  std::string err;
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/all --bits 4 --threads 2", &err),
            0) << err;
  const std::string l0 = "model.layers.0.", l1 = "model.layers.1.";
  for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    EXPECT_EQ(BitsOf(dir + "/all", l0 + "self_attn." + proj), 4) << proj;
    EXPECT_EQ(BitsOf(dir + "/all", l1 + "self_attn." + proj), 4) << proj;
  }
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    EXPECT_EQ(BitsOf(dir + "/all", l0 + "mlp." + proj), 4) << proj;
  }
  EXPECT_EQ(BitsOf(dir + "/all", "lm_head"), 6);
  EXPECT_EQ(BitsOf(dir + "/all", l1 + "mlp.experts.1.down_proj"), 4);
  const double head_err = RelativeError(dir + "/hf", dir + "/all", "lm_head");
  EXPECT_LT(head_err, 1.5 * std::pow(4.0, -6));
  EXPECT_GT(head_err, 0.8 * std::pow(4.0, -6));
  EXPECT_LT(RelativeError(dir + "/hf", dir + "/all", l0 + "self_attn.q_proj"), 1.5 * std::pow(4.0, -4));
  {
    auto src = TensorSource::Open(dir + "/all");
    ASSERT_TRUE(src.ok());
    for (const char* kept : {"model.embed_tokens.weight", "model.norm.weight",
                                    "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.gate.weight",
                                    "model.layers.1.mlp.gate.e_score_correction_bias"}) {
      EXPECT_TRUE((*src)->Has(kept)) << kept;
    }
    EXPECT_FALSE((*src)->Has("lm_head.weight"));
    EXPECT_FALSE((*src)->Has(l0 + "self_attn.q_proj.weight"));
  }
  nlohmann::json q = QuantizationConfig(dir + "/all");
  EXPECT_EQ(q.value("quantized_modules", ""), "routed_experts,shared_experts,attention,dense_mlp,head");
  EXPECT_EQ(q.value("head_bits", 0), 6);
  EXPECT_EQ(q.value("attention_bits", 0), 4);
  EXPECT_EQ(q.value("dense_mlp_bits", 0), 4);
  EXPECT_FALSE(q.contains("unquantized_linears"));
  absl::StatusOr<MoeConfig> cfg = LoadMoeConfig(dir + "/all");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_DOUBLE_EQ(cfg->head_bits, 6.0);
  ASSERT_TRUE(Exl3Model::Open(dir + "/all").ok());

  // The experts-only conversion, and --head-bits.
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/experts --bits 4 "
                 "--no-quantize-attention --no-quantize-dense-mlp --no-quantize-head", &err),
            0) << err;
  EXPECT_EQ(BitsOf(dir + "/experts", l0 + "self_attn.q_proj"), 0);
  EXPECT_EQ(BitsOf(dir + "/experts", l0 + "mlp.gate_proj"), 0);
  EXPECT_EQ(BitsOf(dir + "/experts", "lm_head"), 0);
  EXPECT_EQ(BitsOf(dir + "/experts", l1 + "mlp.experts.0.gate_proj"), 4);
  q = QuantizationConfig(dir + "/experts");
  EXPECT_EQ(q.value("quantized_modules", ""), "routed_experts,shared_experts");
  EXPECT_FALSE(q.contains("head_bits"));
  EXPECT_FALSE(q.contains("attention_bits"));
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/head5 --bits 3 "
                 "--head-bits 5 --no-quantize-attention --quantize-dense-mlp", &err),
            0) << err;
  EXPECT_EQ(BitsOf(dir + "/head5", "lm_head"), 5);
  EXPECT_EQ(BitsOf(dir + "/head5", l0 + "mlp.down_proj"), 3);
  EXPECT_EQ(BitsOf(dir + "/head5", l0 + "self_attn.o_proj"), 0);
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/x --bits 3 --head-bits 9", &err), 0);
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/x --bits 3 "
                 "--quantize-attention --no-quantize-attention", &err), 0);
  EXPECT_NE(err.find("contradicts"), std::string::npos) << err;

  // Tied embeddings: no lm_head tensor; the head stays the (unquantized) embedding.
  fs::create_directories(dir + "/tied");
  for (const auto& e : fs::directory_iterator(dir + "/hf")) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") continue;
    auto f = SafetensorsFile::Open(e.path().string());
    ASSERT_TRUE(f.ok());
    SafetensorsWriter w;
    for (const TensorInfo& t : (*f)->tensors()) {
      if (t.name == "lm_head.weight") continue;
      auto v = (*f)->Get(t.name);
      ASSERT_TRUE(v.ok());
      w.Add(t.name, t.dtype, t.shape, v->data, v->size_bytes());
    }
    ASSERT_TRUE(w.Write(dir + "/tied/" + name).ok());
  }
  {
    std::ifstream in(dir + "/hf/config.json");
    nlohmann::json c = nlohmann::json::parse(in);
    c["tie_word_embeddings"] = true;
    std::ofstream(dir + "/tied/config.json") << c.dump(2);
  }
  ASSERT_EQ(Tool("quantize --input " + dir + "/tied --output " + dir + "/tied-q --bits 4 --threads 2", &err),
            0) << err;
  EXPECT_NE(err.find("tie_word_embeddings"), std::string::npos) << err;
  EXPECT_EQ(BitsOf(dir + "/tied-q", l0 + "self_attn.q_proj"), 4);
  q = QuantizationConfig(dir + "/tied-q");
  EXPECT_FALSE(q.contains("head_bits"));
  EXPECT_EQ(q.value("quantized_modules", ""), "routed_experts,shared_experts,attention,dense_mlp");

  // DeepSeek-V3's MLA test layout has projections of 48 and 64 rows: they stay as stored.
  ASSERT_EQ(Tool("make-test-model --quiet --arch deepseek_v3 --output " + dir + "/ds --hf-only --hidden 256 "
                 "--intermediate 128 --experts 4 --top-k 2 --layers 2 --n-group 2 --topk-group 1"),
            0);
  ASSERT_EQ(Tool("quantize --input " + dir + "/ds --output " + dir + "/ds-q --bits 4 --threads 2", &err), 0)
      << err;
  EXPECT_NE(err.find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight [48, 256] BF16: dimensions not "
                     "both multiples of 128, kept as stored"),
            std::string::npos)
      << err;
  EXPECT_EQ(BitsOf(dir + "/ds-q", l0 + "self_attn.o_proj"), 4);  // [256, 128]
  {
    auto src = TensorSource::Open(dir + "/ds-q");
    ASSERT_TRUE(src.ok());
    EXPECT_TRUE((*src)->Has(l0 + "self_attn.kv_a_proj_with_mqa.weight"));
    EXPECT_TRUE((*src)->Has(l0 + "self_attn.q_a_proj.weight"));
  }
  q = QuantizationConfig(dir + "/ds-q");
  ASSERT_TRUE(q.contains("unquantized_linears"));
  // kv_b_proj stays as stored whatever its shape (exllamav3 reads only its .weight), unasked.
  EXPECT_EQ(std::find(q["unquantized_linears"].begin(), q["unquantized_linears"].end(),
                      "model.layers.1.self_attn.kv_b_proj.weight"),
            q["unquantized_linears"].end());
  EXPECT_EQ(BitsOf(dir + "/ds-q", l1 + "self_attn.kv_b_proj"), 0);

  // GLM-MoE-DSA's indexer: wq_b quantized like the attention; wk and weights_proj (router-like)
  // copied as stored without being asked for (not listed among the linears EXL3 cannot hold), as
  // exllamav3 keeps them; so is kv_b_proj [256, 128], which EXL3 could hold.
  ASSERT_EQ(Tool("make-test-model --quiet --arch glm_moe_dsa --output " + dir + "/dsa --hf-only "
                 "--hidden 256 --intermediate 128 --dense-intermediate 128 --experts 2 --top-k 1 "
                 "--layers 2 --heads 4 --q-lora-rank 128 --index-heads 2 --index-head-dim 128"),
            0);
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/dsa --output " + dir + "/dsa-q --bits 2 --threads 2 "
                 "--no-quantize-dense-mlp --no-quantize-head", &err), 0)
      << err;
  EXPECT_EQ(BitsOf(dir + "/dsa-q", l0 + "self_attn.indexer.wq_b"), 2);  // [256, 128]
  EXPECT_EQ(BitsOf(dir + "/dsa-q", l0 + "self_attn.indexer.wk"), 0);    // [128, 256]
  {
    auto src = TensorSource::Open(dir + "/dsa-q");
    ASSERT_TRUE(src.ok());
    for (const char* kept : {"self_attn.indexer.weights_proj.weight",  // [2, 256]
                             "self_attn.indexer.wk.weight", "self_attn.kv_b_proj.weight"}) {
      EXPECT_TRUE((*src)->Has(l0 + kept)) << kept;
      EXPECT_TRUE((*src)->Has(l1 + kept)) << kept;
    }
    EXPECT_FALSE((*src)->Has(l0 + "self_attn.indexer.weights_proj.trellis"));
    EXPECT_TRUE((*src)->Has(l0 + "self_attn.indexer.k_norm.bias"));
  }
  q = QuantizationConfig(dir + "/dsa-q");
  if (q.contains("unquantized_linears")) {
    for (const char* kept : {"self_attn.indexer.weights_proj.weight", "self_attn.indexer.wk.weight",
                             "self_attn.kv_b_proj.weight"}) {
      EXPECT_EQ(std::find(q["unquantized_linears"].begin(), q["unquantized_linears"].end(), l0 + kept),
                q["unquantized_linears"].end())
          << kept;
    }
  }
}

TEST(EncoderTools, SyntheticModelOpensWithRandomTrellis) {
  const std::string dir = TempDir("synthetic");
  ASSERT_EQ(Tool("make-test-model --quiet --synthetic --arch deepseek_v3 --output " + dir + "/m --hidden 256 "
                 "--intermediate 128 --experts 8 --top-k 2 --layers 3 --dense-layers 1 --bits 2 "
                 "--down-bits 4 --codebook mcg"),
            0);
  auto model = Exl3Model::Open(dir + "/m");
  ASSERT_TRUE(model.ok()) << model.status();
  const MoeConfig& c = (*model)->config();
  EXPECT_EQ(c.MoeLayers(), (std::vector<int>{1, 2}));
  EXPECT_EQ((*model)->HeldExperts(2).size(), 8u);
  EXPECT_NE((*model)->SharedExpert(1), nullptr);
  EXPECT_EQ((*model)->tensors().Get(RoutedExpertPrefix(c, 2, 7, Projection::kDown) + ".trellis")->info->shape,
            (std::vector<int64_t>{8, 16, 64}));
  EXPECT_TRUE(fs::exists(dir + "/m/model-00002-of-00002.safetensors"));  // a shard per MoE layer
  std::string err;
  EXPECT_EQ(Tool("inspect --model " + dir + "/m", &err), 0) << err;
  // Written without the converter: no digests until exl3-tool digest records them.
  EXPECT_FALSE((*model)->fingerprint_covers_weights());
  ASSERT_EQ(Tool("digest --model " + dir + "/m", &err), 0) << err;
  auto digested = Exl3Model::Open(dir + "/m");
  ASSERT_TRUE(digested.ok()) << digested.status();
  EXPECT_TRUE((*digested)->fingerprint_covers_weights());
  EXPECT_NE((*digested)->fingerprint(), (*model)->fingerprint());
}

// --expert-bits-cycle / --expert-codebook-cycle: routed experts that differ in K and codebook (the
// layers the CUDA MoE path groups into (K, codebook) classes, kernels/moe_classes.h).
TEST(EncoderTools, SyntheticModelWithPerExpertBitsAndCodebooks) {
  const std::string dir = TempDir("synthetic-mixed");
  std::string err;
  ASSERT_EQ(Tool("make-test-model --quiet --synthetic --arch deepseek_v3 --output " + dir + "/m --hidden 256 "
                 "--intermediate 128 --experts 8 --top-k 2 --layers 2 --dense-layers 1 --bits 2 "
                 "--codebook mcg --expert-bits-cycle 2,3,4 --expert-codebook-cycle mcg,3inst", &err),
            0)
      << err;
  auto model = Exl3Model::Open(dir + "/m");
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<MoeLayerView> layer = (*model)->LayerView(1);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_EQ(layer->num_experts(), 8);
  for (int e = 0; e < 8; ++e) {
    ASSERT_NE(layer->experts[e], nullptr);
    for (const Exl3LinearView* v : {&layer->experts[e]->gate, &layer->experts[e]->up, &layer->experts[e]->down}) {
      EXPECT_EQ(v->bits, 2 + e % 3) << "expert " << e;
      EXPECT_EQ(v->codebook, e % 2 ? Codebook::k3Inst : Codebook::kMcg) << "expert " << e;
    }
  }
  ASSERT_NE(layer->shared, nullptr);  // the shared expert keeps --bits and --codebook
  EXPECT_EQ(layer->shared->down.bits, 2);
  EXPECT_EQ(layer->shared->down.codebook, Codebook::kMcg);
  EXPECT_EQ(Tool("make-test-model --quiet --arch deepseek_v3 --output " + dir + "/hf --expert-bits-cycle 2,3"), 1);
  EXPECT_EQ(Tool("make-test-model --quiet --synthetic --arch deepseek_v3 --output " + dir + "/bad "
                 "--expert-bits-cycle 2,9"),
            1);
}

// GLM-5.3-Flash (Glm5NextForConditionalGeneration): text_config nested, text tensors under
// model.language_model.; attention projections, dense MLPs, experts and the head are quantized,
// KDA's gate projections (f_a/f_b/g_a/g_b/b_proj) and MLA's kv_b_proj stay as stored even where
// EXL3 could hold them, and the vision tower and the MTP layer (layers.{num_hidden_layers}) are
// copied as stored. KDA's q/k/v are written as exllamav3 writes them: one EXL3 layer qkv_proj (q,
// k, v rows in that order) and one conv1d [3 W, 1, K].
TEST(EncoderTools, QuantizeGlm5NextKeepsGatesVisionAndMtpAsStored) {
  const std::string dir = TempDir("glm5next");
  fs::create_directories(dir + "/hf");
  const int H = 128;
  nlohmann::json text = {
      {"hidden_size", H}, {"num_hidden_layers", 2}, {"vocab_size", 128}, {"intermediate_size", 128},
      {"moe_intermediate_size", 128}, {"n_routed_experts", 2}, {"num_experts_per_tok", 1},
      {"n_shared_experts", 1}, {"num_attention_heads", 1}, {"num_key_value_heads", 1},
      {"q_lora_rank", 128}, {"kv_lora_rank", 128}, {"qk_nope_head_dim", 128}, {"v_head_dim", 128},
      {"qk_rope_head_dim", 0}, {"linear_num_heads", 1}, {"linear_head_dim", 128},
      {"max_position_embeddings", 64}, {"layer_types", {"linear_attention", "indexed_attention"}},
      {"mlp_layer_types", {"dense", "sparse"}}, {"index_topk", 16}, {"index_kpool", 4},
      {"index_n_heads", 1}, {"index_head_dim", 128}};
  nlohmann::json cfg = {{"architectures", {"Glm5NextForConditionalGeneration"}},
                        {"model_type", "glm5_next"}, {"text_config", text},
                        {"vision_config", {{"depth", 1}}}};
  std::ofstream(dir + "/hf/config.json") << cfg.dump(2);
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 0.1f);
  std::vector<std::vector<float>> data;
  SafetensorsWriter w;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<float>& v = data.emplace_back(count);
    for (float& x : v) x = n(rng);
    w.Add(name, DType::kF32, shape, v.data(), v.size() * 4);
  };
  const std::string t = "model.language_model.", l0 = t + "layers.0.", l1 = t + "layers.1.";
  add(t + "embed_tokens.weight", {128, H});
  add(t + "norm.weight", {H});
  add("lm_head.weight", {128, H});
  for (const char* p : {"q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "o_proj", "f_a_proj", "g_a_proj"})
    add(l0 + "self_attn." + p + ".weight", {128, 128});
  add(l0 + "self_attn.b_proj.weight", {1, H});
  for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"}) add(l0 + "self_attn." + conv + ".weight", {128, 1, 4});
  for (const char* p : {"gate_proj", "up_proj", "down_proj"}) add(l0 + "mlp." + p + ".weight", {128, 128});
  for (const char* p : {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"})
    add(l1 + "self_attn." + p + ".weight", {128, 128});
  add(l1 + "self_attn.kv_b_proj.weight", {256, 128});
  for (int e = 0; e < 2; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      add(l1 + "mlp.experts." + std::to_string(e) + "." + p + ".weight", {128, 128});
  for (const char* p : {"gate_proj", "up_proj", "down_proj"})
    add(l1 + "mlp.shared_experts." + p + ".weight", {128, 128});
  add(l1 + "mlp.gate.weight", {2, H});
  add(l1 + "mlp.gate.e_score_correction_bias", {2});
  add(t + "layers.2.self_attn.q_a_proj.weight", {128, 128});  // the MTP layer
  add("model.visual.blocks.0.attn.qkv.weight", {384, 128});    // the vision tower
  ASSERT_TRUE(w.Write(dir + "/hf/model.safetensors").ok());

  std::string err;
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q --bits 4 --threads 2", &err), 0)
      << err;
  for (const char* p : {"qkv_proj", "o_proj"}) EXPECT_EQ(BitsOf(dir + "/q", l0 + "self_attn." + p), 4) << p;
  for (const char* p : {"f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "q_proj", "k_proj", "v_proj"})
    EXPECT_EQ(BitsOf(dir + "/q", l0 + "self_attn." + p), 0) << p;
  EXPECT_EQ(BitsOf(dir + "/q", l0 + "mlp.down_proj"), 4);
  EXPECT_EQ(BitsOf(dir + "/q", l1 + "self_attn.kv_b_proj"), 0);
  EXPECT_EQ(BitsOf(dir + "/q", l1 + "self_attn.q_b_proj"), 4);
  EXPECT_EQ(BitsOf(dir + "/q", l1 + "mlp.experts.1.up_proj"), 4);
  EXPECT_EQ(BitsOf(dir + "/q", t + "layers.2.self_attn.q_a_proj"), 0);
  EXPECT_EQ(BitsOf(dir + "/q", "model.visual.blocks.0.attn.qkv"), 0);
  auto src = TensorSource::Open(dir + "/q");
  ASSERT_TRUE(src.ok()) << src.status();
  for (const std::string& kept : {l0 + "self_attn.f_a_proj.weight", t + "layers.2.self_attn.q_a_proj.weight",
                                 std::string("model.visual.blocks.0.attn.qkv.weight"),
                                 l1 + "self_attn.kv_b_proj.weight"})
    EXPECT_TRUE((*src)->Has(kept)) << kept;
  for (const char* gone : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                           "v_conv1d.weight"})
    EXPECT_FALSE((*src)->Has(l0 + "self_attn." + gone)) << gone;
  // The fused layer is the three projections' rows, quantized as one.
  std::vector<float> qkv;
  for (const char* p : {"q_proj", "k_proj", "v_proj"}) {
    const std::vector<float> w = Load(*TensorSource::Open(dir + "/hf").value(), l0 + "self_attn." + p + ".weight");
    qkv.insert(qkv.end(), w.begin(), w.end());
  }
  absl::StatusOr<std::unique_ptr<Exl3Linear>> fused = LoadExl3Linear(**src, l0 + "self_attn.qkv_proj", 128, 384);
  ASSERT_TRUE(fused.ok()) << fused.status();
  EXPECT_LT(DequantRelativeError((*fused)->view, qkv), 1.5 * std::pow(4.0, -4));
  // The convolutions' rows side by side, as stored.
  std::vector<float> convs;
  for (const char* c : {"q_conv1d", "k_conv1d", "v_conv1d"}) {
    const std::vector<float> w = Load(*TensorSource::Open(dir + "/hf").value(), l0 + "self_attn." + c + ".weight");
    convs.insert(convs.end(), w.begin(), w.end());
  }
  EXPECT_EQ((*src)->Info(l0 + "self_attn.conv1d.weight").value()->shape, (std::vector<int64_t>{384, 1, 4}));
  EXPECT_EQ(Load(**src, l0 + "self_attn.conv1d.weight"), convs);
  EXPECT_EQ(QuantizationConfig(dir + "/q").value("quant_method", ""), "exl3");
  ASSERT_TRUE(Exl3Model::Open(dir + "/q").ok());

  // Without attention quantized, q/k/v and their convolutions stay as stored (exllamav3 reads
  // unquantized q/k/v as the list it concatenates).
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/experts --bits 4 --threads 2 "
                 "--no-quantize-attention", &err),
            0)
      << err;
  auto experts = TensorSource::Open(dir + "/experts");
  ASSERT_TRUE(experts.ok()) << experts.status();
  for (const char* kept : {"q_proj.weight", "v_proj.weight", "k_conv1d.weight"})
    EXPECT_TRUE((*experts)->Has(l0 + "self_attn." + kept)) << kept;
  EXPECT_FALSE((*experts)->Has(l0 + "self_attn.qkv_proj.trellis"));
  EXPECT_FALSE((*experts)->Has(l0 + "self_attn.conv1d.weight"));
}

// DeepSeek-V4 as released (and as exllamav3 reads it: model/checkpoint_naming.h) converts into an
// EXL3 directory in the same naming, the same layers quantized as from transformers' names.
TEST(EncoderTools, QuantizeKeepsDeepseekV4ReleaseNaming) {
  const std::string dir = TempDir("dsv4_release");
  ASSERT_EQ(Tool("make-test-model --quiet --arch deepseek_v4 --output " + dir + "/exl3 --hidden 128 "
                 "--intermediate 128 --experts 4 --top-k 2 --layers 2 --bits 2 --seed 7 --heads 2 --head-dim 128 "
                 "--o-lora-rank 128"),
            0);
  // The transformers-named checkpoint rewritten under the release names (stored name: what
  // ProjectTensorName maps back to the transformers name).
  fs::create_directories(dir + "/release");
  fs::copy_file(dir + "/exl3-hf/config.json", dir + "/release/config.json");
  auto tf = TensorSource::Open(dir + "/exl3-hf");
  ASSERT_TRUE(tf.ok()) << tf.status();
  auto release_name = [](const std::string& name) {
    std::string n = absl::StartsWith(name, "model.") ? name.substr(6) : name;
    if (absl::StartsWith(n, "layers.") && n.find(".attn.norm.") != std::string::npos)
      n.replace(n.find(".attn.norm."), 11, ".attn.kv_norm.");
    if (absl::StartsWith(n, "embed_tokens.")) n = "embed." + n.substr(13);
    if (absl::StartsWith(n, "hc_head.hc_")) n = "hc_head_" + n.substr(11);
    return n;
  };
  SafetensorsWriter w;
  for (const std::string& name : (*tf)->Names()) {
    TensorView v = *(*tf)->Get(name);
    const std::string stored = release_name(name);
    ASSERT_EQ(ProjectTensorName(CheckpointNaming::kDeepseekRelease, stored), name);
    w.Add(stored, v.info->dtype, v.info->shape, v.data, v.size_bytes());
  }
  ASSERT_TRUE(w.Write(dir + "/release/model.safetensors").ok());

  std::string err;
  for (const char* in : {"exl3-hf", "release"}) {
    ASSERT_EQ(Tool(absl::StrCat("quantize --quiet --input ", dir, "/", in, " --output ", dir, "/q-", in,
                                " --bits 4 --head-bits 6 --threads 2"), &err), 0) << in << ": " << err;
  }
  auto q = SafetensorsFile::Open(dir + "/q-release/model.safetensors");
  ASSERT_TRUE(q.ok()) << q.status();
  std::vector<std::string> stored;
  for (const TensorInfo& t : (*q)->tensors()) stored.push_back(t.name);
  EXPECT_EQ(DetectCheckpointNaming(stored), CheckpointNaming::kDeepseekRelease);
  for (const char* name : {"embed.weight", "norm.weight", "hc_head_fn", "head.trellis",
                           "layers.1.attn.wo_b.trellis", "layers.1.attn.kv_norm.weight",
                           "layers.1.ffn.experts.3.w2.trellis", "layers.1.attn.wo_a.slice.0.trellis",
                           "layers.1.attn.wo_a.slice.1.trellis"})
    EXPECT_NE(std::find(stored.begin(), stored.end(), name), stored.end()) << name;
  // wo_a as exllamav3 writes it: each output group's rows an EXL3 layer of its own.
  for (const char* gone : {"layers.1.attn.wo_a.trellis", "layers.1.attn.wo_a.weight", "layers.1.attn.wo_a.slice.2.trellis"})
    EXPECT_EQ(std::find(stored.begin(), stored.end(), gone), stored.end()) << gone;
  {
    auto q_src = TensorSource::Open(dir + "/q-release");
    ASSERT_TRUE(q_src.ok()) << q_src.status();
    const std::vector<float> wo_a = Load(**tf, "model.layers.1.attn.wo_a.weight");
    const std::vector<int64_t>& shape = (*tf)->Info("model.layers.1.attn.wo_a.weight").value()->shape;
    const int64_t rows = shape[0] / 2, in = shape[1];
    for (int g = 0; g < 2; ++g) {
      auto slice = LoadExl3Linear(**q_src, absl::StrCat("model.layers.1.attn.wo_a.slice.", g), in, rows);
      ASSERT_TRUE(slice.ok()) << slice.status();
      const std::vector<float> want(wo_a.begin() + g * rows * in, wo_a.begin() + (g + 1) * rows * in);
      EXPECT_LT(DequantRelativeError((*slice)->view, want), 1.5 * std::pow(4.0, -4)) << g;
    }
  }
  // The same layers EXL3 at the same widths, whichever naming came in.
  auto a = TensorSource::Open(dir + "/q-exl3-hf");
  auto b = TensorSource::Open(dir + "/q-release");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->Names(), (*b)->Names());
  for (const std::string& name : (*a)->Names()) {
    if (!absl::EndsWith(name, ".trellis")) continue;
    EXPECT_EQ((*a)->Info(name).value()->shape, (*b)->Info(name).value()->shape) << name;
  }
  for (const auto& kept : QuantizationConfig(dir + "/q-release").value("unquantized_linears", nlohmann::json::array()))
    EXPECT_NE(std::find(stored.begin(), stored.end(), kept.get<std::string>()), stored.end()) << kept;
  auto model = Exl3Model::Open(dir + "/q-release");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->HeldExperts(1).size(), 4u);
}

// DeepSeek-V4's DSPARK drafter (mtp.*, docs/dspark.md) in a file of its own beside the model: the
// linears exllamav3's converter quantizes (qbits_key "mtp_bits": main_proj, the attention's wq_a /
// wq_b / wkv / wo_a as per-group slices / wo_b, routed and shared experts) become EXL3 at --mtp-bits
// where EXL3 can hold them; the router, norms, hyper-connections, sinks and the Markov and
// confidence heads stay as stored (exllamav3 reads them unquantized).
TEST(EncoderTools, QuantizeCarriesDeepseekV4DsparkDrafter) {
  const std::string dir = TempDir("dsv4_dspark");
  ASSERT_EQ(Tool("make-test-model --quiet --arch deepseek_v4 --output " + dir + "/exl3 --hidden 128 "
                 "--intermediate 128 --experts 4 --top-k 2 --layers 2 --bits 2 --seed 7 --heads 2 --head-dim 128 "
                 "--o-lora-rank 128"),
            0);
  // The model's shards without their index (every shard is then read, mtp.safetensors too).
  fs::create_directories(dir + "/hf");
  for (const auto& e : fs::directory_iterator(dir + "/exl3-hf")) {
    const std::string f = e.path().filename().string();
    if (f == "config.json" || (e.path().extension() == ".safetensors"))
      fs::copy_file(e.path(), dir + "/hf/" + f);
  }
  auto tf = TensorSource::Open(dir + "/exl3-hf");
  ASSERT_TRUE(tf.ok()) << tf.status();
  // Block 0 of the drafter: layer 1's attention projections, norms, router and experts under
  // mtp.0.* (what a sliding block stores), and the drafter's own tensors.
  SafetensorsWriter w;
  const std::string l1 = "model.layers.1.";
  for (const std::string& name : (*tf)->Names()) {
    if (!absl::StartsWith(name, l1) || name.find("compressor") != std::string::npos ||
        name.find("indexer") != std::string::npos)
      continue;
    TensorView v = *(*tf)->Get(name);
    std::string rest = name.substr(l1.size());
    if (rest == "attn.norm.weight") rest = "attn.kv_norm.weight";
    w.Add("mtp.0." + rest, v.info->dtype, v.info->shape, v.data, v.size_bytes());
  }
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng);
    w.AddF32(name, shape, v.data());
  };
  add("mtp.0.main_proj.weight", {128, 256});  // two taps
  add("mtp.0.main_norm.weight", {128});
  add("mtp.0.hc_head_fn", {4, 512});
  add("mtp.0.hc_head_base", {4});
  add("mtp.0.hc_head_scale", {1});
  add("mtp.0.norm.weight", {128});
  add("mtp.0.markov_head.markov_w1.weight", {128, 128});  // [vocab, rank]: an embedding table
  add("mtp.0.markov_head.markov_w2.weight", {128, 128});
  add("mtp.0.confidence_head.proj.weight", {1, 256});
  ASSERT_TRUE(w.Write(dir + "/hf/mtp.safetensors").ok());

  std::string err;
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q --bits 4 --mtp-bits 3 --threads 2", &err),
            0)
      << err;
  auto q = SafetensorsFile::Open(dir + "/q/mtp.safetensors");
  ASSERT_TRUE(q.ok()) << q.status();
  std::map<std::string, std::vector<int64_t>> stored;
  for (const TensorInfo& t : (*q)->tensors()) stored[t.name] = t.shape;
  auto has = [&](const std::string& name) { return stored.count(name) > 0; };
  for (const char* l : {"main_proj", "attn.wkv", "attn.wo_b", "attn.wo_a.slice.0", "attn.wo_a.slice.1",
                        "ffn.experts.0.w1", "ffn.experts.3.w2", "ffn.shared_experts.w3"}) {
    EXPECT_TRUE(has(absl::StrCat("mtp.0.", l, ".trellis"))) << l;
    EXPECT_FALSE(has(absl::StrCat("mtp.0.", l, ".weight"))) << l;
  }
  // At --mtp-bits 3: the trellis' last dimension is 16 * K.
  EXPECT_EQ(stored["mtp.0.attn.wkv.trellis"].back(), 48);
  EXPECT_EQ(stored["mtp.0.ffn.experts.3.w2.trellis"].back(), 48);
  EXPECT_FALSE(has("mtp.0.attn.wo_a.trellis"));
  EXPECT_FALSE(has("mtp.0.attn.wo_a.weight"));
  // q_lora_rank 64: wq_a [64, 128] and wq_b [256, 64] are not EXL3-able, kept and listed.
  for (const char* kept : {"attn.wq_a.weight", "attn.wq_b.weight", "ffn.gate.weight", "ffn.gate.bias",
                           "attn.kv_norm.weight", "attn.attn_sink", "hc_attn_fn", "hc_ffn_scale", "main_norm.weight",
                           "hc_head_fn", "norm.weight", "markov_head.markov_w1.weight",
                           "markov_head.markov_w2.weight", "confidence_head.proj.weight"})
    EXPECT_TRUE(has(absl::StrCat("mtp.0.", kept))) << kept;
  const nlohmann::json qc = QuantizationConfig(dir + "/q");
  EXPECT_EQ(qc.value("mtp_bits", 0), 3);
  EXPECT_NE(qc.value("quantized_modules", std::string()).find("mtp"), std::string::npos);
  std::vector<std::string> unq = qc.value("unquantized_linears", std::vector<std::string>());
  EXPECT_NE(std::find(unq.begin(), unq.end(), "mtp.0.attn.wq_a.weight"), unq.end());
  {
    auto src = TensorSource::Open(dir + "/q");
    ASSERT_TRUE(src.ok()) << src.status();
    const std::vector<float> wo_a = Load(**tf, l1 + "attn.wo_a.weight");
    for (int g = 0; g < 2; ++g) {
      auto slice = LoadExl3Linear(**src, absl::StrCat("mtp.0.attn.wo_a.slice.", g), 128, 128);
      ASSERT_TRUE(slice.ok()) << slice.status();
      const std::vector<float> want(wo_a.begin() + g * 128 * 128, wo_a.begin() + (g + 1) * 128 * 128);
      EXPECT_LT(DequantRelativeError((*slice)->view, want), 1.5 * std::pow(4.0, -3)) << g;
    }
  }
  // The trunk opens as before.
  auto model = Exl3Model::Open(dir + "/q");
  ASSERT_TRUE(model.ok()) << model.status();

  // --no-quantize-mtp: mtp.* as it came.
  ASSERT_EQ(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q-kept --bits 4 --no-quantize-mtp "
                 "--threads 2", &err),
            0)
      << err;
  auto kept = SafetensorsFile::Open(dir + "/q-kept/mtp.safetensors");
  ASSERT_TRUE(kept.ok()) << kept.status();
  for (const TensorInfo& t : (*kept)->tensors()) EXPECT_FALSE(absl::EndsWith(t.name, ".trellis")) << t.name;
  EXPECT_FALSE(QuantizationConfig(dir + "/q-kept").contains("mtp_bits"));
  EXPECT_NE(Tool("quantize --quiet --input " + dir + "/hf --output " + dir + "/q-bad --bits 4 --no-quantize-mtp "
                 "--mtp-bits 4", &err),
            0);
}

}  // namespace
}  // namespace exl3
