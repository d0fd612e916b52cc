// Models of every family as exl3-tool make-test-model writes them (a Hugging Face
// checkpoint with random weights, converted with --quantize-all: experts, attention, dense MLPs
// and the head EXL3): each loads in the CPU engine and generates, and every MoE layer inside the
// engine answers as `exl3-tool moe` does on the hidden states (and token ids) the engine gave it;
// `exl3-tool inspect` describes each.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "tests/engine/engine_requests.h"
#include "engine/cpu/local_moe.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/model_harness.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

// Records each MoE call of the engine (input, token ids, output) while running it in process.
class RecordingMoe final : public MoeExecutor {
 public:
  struct Call {
    std::vector<float> x, y;
    std::vector<int32_t> ids;
  };
  explicit RecordingMoe(std::unique_ptr<LocalMoe> local, int hidden) : local_(std::move(local)), hidden_(hidden) {}
  absl::Status Forward(int layer, const float* x, int T, const int32_t* ids, float* y) override {
    absl::Status st = local_->Forward(layer, x, T, ids, y);
    Call& c = calls[layer];  // the last call of each layer
    c.x.assign(x, x + static_cast<size_t>(T) * hidden_);
    c.y.assign(y, y + static_cast<size_t>(T) * hidden_);
    c.ids.assign(ids, ids + T);
    return st;
  }
  std::map<int, Call> calls;

 private:
  std::unique_ptr<LocalMoe> local_;
  int hidden_;
};

// Runs exl3-tool; its stdout goes to `stdout_path`.
int Tool(const std::string& args, const std::string& stdout_path = "/dev/null") {
  return std::system((std::string(EXL3_TOOL_BINARY) + " " + args + " > " + stdout_path).c_str());
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

using testing::RelativeError;

struct Case {
  const char* arch;
  const char* flags;  // beyond the common tiny shape
  size_t moe_layers;
  const char* architecture;  // config.json's, as `exl3-tool inspect` names it
};

class GeneratedModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(GeneratedModelTest, LoadsGeneratesAndItsMoeLayersMatchTheTool) {
  const Case& c = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       (std::string("exl3_generated_") + c.arch + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string model = (dir / "exl3").string();
  ASSERT_EQ(Tool(std::string("make-test-model --quiet --arch ") + c.arch + " --output " + model +
                 " --hidden 128 --intermediate 128 --experts 4 --top-k 2 --layers 3 --vocab 64"
                 " --bits 4 --quantize-all --threads 2 --seed 5 " + c.flags),
            0);

  const std::string described = (dir / "inspect.txt").string();
  ASSERT_EQ(Tool("inspect --model " + model, described), 0);
  const std::string inspect = ReadText(described);
  EXPECT_NE(inspect.find(c.architecture), std::string::npos) << inspect;

  CpuCompute compute(2);
  auto local = LocalMoe::Open(model, compute);
  ASSERT_TRUE(local.ok()) << local.status();
  auto cfg = LoadModelConfig(model);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto recording = std::make_unique<RecordingMoe>(std::move(*local), cfg->hidden_size);
  RecordingMoe* rec = recording.get();
  CpuModelOptions o;
  o.num_threads = 2;
  auto m = CpuModel::Open(model, o, std::move(recording));
  ASSERT_TRUE(m.ok()) << m.status();
  // 13 prompt tokens in chunks of 5, then 6 decode steps: every compressor window kind closes.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 13; ++i) prompt.push_back((i * 7 + 3) % 64);
  auto rows = testing::RunGreedy(**m, {prompt}, 6, /*chunk=*/5);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ((*rows)[0].size(), 7u);
  for (const std::vector<float>& row : (*rows)[0])
    for (float v : row) ASSERT_TRUE(std::isfinite(v));

  // The last call of every MoE layer (a decode step) through `exl3-tool moe`.
  ASSERT_EQ(rec->calls.size(), c.moe_layers);
  for (const auto& [layer, call] : rec->calls) {
    const int T = static_cast<int>(call.ids.size());
    const std::string x = (dir / ("x" + std::to_string(layer) + ".safetensors")).string();
    const std::string y = (dir / ("y" + std::to_string(layer) + ".safetensors")).string();
    SafetensorsWriter w;
    w.AddF32("x", {T, cfg->hidden_size}, call.x.data());
    w.Add("token_ids", DType::kI32, {T}, call.ids.data(), call.ids.size() * sizeof(int32_t));
    ASSERT_TRUE(w.Write(x).ok());
    ASSERT_EQ(Tool("moe --model " + model + " --layer " + std::to_string(layer) + " --x " + x +
                   " --output " + y + " --backend cpu --threads 2"),
              0);
    auto out = SafetensorsFile::Open(y);
    ASSERT_TRUE(out.ok()) << out.status();
    const float* tool_y = (*out)->Get("y")->as<float>();
    const double err = RelativeError(call.y.data(), tool_y, call.y.size());
    EXPECT_LT(err, 1e-5) << c.arch << " layer " << layer;
    std::printf("%s MoE layer %d: engine vs exl3-tool moe rel err %.2e\n", c.arch, layer, err);
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Families, GeneratedModelTest,
    ::testing::Values(
        // The families of the transformers fixtures, at make-test-model's default layouts: the
        // first layer dense (first_k_dense_replace 1) or every layer MoE.
        Case{"glm4_moe", "", 2, "Glm4MoeForCausalLM"}, Case{"qwen3_moe", "", 3, "Qwen3MoeForCausalLM"},
        Case{"mixtral", "", 3, "MixtralForCausalLM"}, Case{"deepseek_v3", "", 2, "DeepseekV3ForCausalLM"},
        Case{"glm_moe_dsa", "", 2, "GlmMoeDsaForCausalLM"},
        // Layers [sliding, CSA, HCA], the first hash-routed; EXL3 attention at head_dim 128.
        Case{"deepseek_v4",
             "--heads 2 --head-dim 128 --q-lora-rank 128 --qk-rope-head-dim 32 --index-heads 2 "
             "--index-head-dim 64 --index-topk 2 --sliding-window 4 --hca-compress-rate 8",
             3, "DeepseekV4ForCausalLM"},
        // Layers [linear, linear, full] (DeltaNet q/k 2 x 64, v 4 x 64), the first dense.
        Case{"qwen3_next", "--heads 2 --kv-heads 1 --head-dim 64 --layer-types "
                           "linear_attention,linear_attention,full_attention --dense-layers 1",
             2, "Qwen3NextForCausalLM"},
        // GLM-5.3-Flash: layers [KDA, indexed, KDA] (KDA 2 x 64; NoPE MLA of 2 heads with the
        // k-pooled indexer, pools of 2, top 4: the 19 positions attend sparsely), the first dense;
        // hyper-connections of 4 streams on every layer.
        Case{"glm5_next",
             "--heads 2 --q-lora-rank 128 --kv-lora-rank 128 --qk-nope-head-dim 64 --v-head-dim 64 "
             "--index-heads 2 --index-head-dim 64 --index-kpool 2 --index-topk 4 --linear-heads 2 "
             "--linear-head-dim 64 --layer-types linear_attention,indexed_attention,linear_attention",
             2, "Glm5NextForConditionalGeneration"},
        // Qwen3.8-Flash-Next: layers [DeltaNet, DeltaNet with the PLE, QSA] (QSA 2 heads of 64 over
        // 1 KV head, an indexer of 2 heads of 32 choosing 2 blocks of 2), every layer MoE; gated
        // hyper-connections of 4 streams; an n-gram table of 4 heads of rows of 32.
        Case{"qwen4_exp",
             "--heads 2 --kv-heads 1 --head-dim 64 --index-heads 2 --index-head-dim 32 --index-kpool 2 "
             "--index-topk 4 --layer-types linear_attention,linear_attention,indexed_attention "
             "--heads-per-ngram 2 --ple-layer-ids 2 --ple-embed-dim 128 --ngram-vocab-size-base 50",
             3, "Qwen4ExpForConditionalGeneration"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.arch); });

// make-test-model --mtp through exl3-tool quantize (which keeps the MTP layer as stored, bf16):
// the engine loads the layer and decodes with --speculative-method mtp as without it.
class GeneratedMtpModelTest : public ::testing::TestWithParam<const char*> {};

TEST_P(GeneratedMtpModelTest, TheConvertedMtpLayerDraftsAndDecodesAsPlainDecoding) {
  const std::string arch = GetParam();
  const fs::path dir = fs::temp_directory_path() / ("exl3_generated_mtp_" + arch + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string model = (dir / "exl3").string();
  ASSERT_EQ(Tool("make-test-model --quiet --mtp --arch " + arch + " --output " + model +
                 " --hidden 128 --intermediate 128 --experts 4 --top-k 2 --layers 2 --vocab 64"
                 " --bits 4 --quantize-all --threads 2 --seed 5"),
            0);
  auto src = TensorSource::Open(model);
  ASSERT_TRUE(src.ok()) << src.status();
  if (arch == "qwen4_exp") {  // its own head, mtp.*
    EXPECT_TRUE((*src)->Has("mtp.fc_hidden.weight") || (*src)->Has("mtp.fc_hidden.trellis"));
    EXPECT_TRUE((*src)->Has("mtp.layers.0.mlp.experts.0.gate_proj.weight") ||
                (*src)->Has("mtp.layers.0.mlp.experts.0.gate_proj.trellis"));
  } else {
    const std::string p = arch == "glm5_next" ? "model.language_model.layers.2." : "model.layers.2.";
    EXPECT_TRUE((*src)->Has(p + "eh_proj.weight"));  // kept as stored
    EXPECT_TRUE((*src)->Has(p + "mlp.experts.0.gate_proj.weight"));
  }
  std::vector<GenerateParams> params;
  for (int i = 0; i < 2; ++i) {
    GenerateParams g;
    for (int t = 0; t < 11 + 4 * i; ++t) g.prompt.push_back((t * 7 + 3 + i) % 64);
    g.max_tokens = 10;
    g.ignore_eos = true;
    g.sampling.temperature = 0.0f;  // greedy
    params.push_back(g);
  }
  auto run = [&](SpeculativeMethod method, EngineStats* stats) {
    EngineOptions eo;
    eo.block_size = 4;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
    eo.scheduler.max_num_batched_tokens = 8;
    eo.scheduler.speculative.method = method;
    eo.scheduler.speculative.num_speculative_tokens = method == SpeculativeMethod::kOff ? 0 : 2;
    CpuModelOptions o;
    o.num_threads = 2;
    auto m = CpuModel::Open(model, o);
    EXPECT_TRUE(m.ok()) << m.status();
    Engine engine(eo, std::move(*m));
    const absl::Status started = engine.Start();
    EXPECT_TRUE(started.ok()) << started;
    std::vector<FinishInfo> finish;
    auto tokens = testing::RunAllAtOnce(engine, params, &finish);
    engine.Stop();
    *stats = engine.Stats();
    return tokens;
  };
  EngineStats plain_stats, mtp_stats;
  const auto plain = run(SpeculativeMethod::kOff, &plain_stats);
  const auto mtp = run(SpeculativeMethod::kMtp, &mtp_stats);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(mtp[i].size(), plain[i].size()) << "request " << i;
    for (size_t t = 0; t < plain[i].size(); ++t)
      EXPECT_EQ(mtp[i][t].token, plain[i][t].token) << "request " << i << ", token " << t;
  }
  EXPECT_GT(mtp_stats.speculative.num_draft_tokens, 0);
  std::printf("%s --mtp through exl3-tool quantize: %lld of %lld drafts accepted\n", arch.c_str(),
              static_cast<long long>(mtp_stats.speculative.num_accepted_tokens),
              static_cast<long long>(mtp_stats.speculative.num_draft_tokens));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Families, GeneratedMtpModelTest,
                         ::testing::Values("glm4_moe", "deepseek_v3", "glm_moe_dsa", "glm5_next", "qwen4_exp"));

}  // namespace
}  // namespace exl3::engine
