#include "tests/services/common/test_model.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "kernels/fp16.h"
#include "model/safetensors.h"
#include "services/common/wire.h"

namespace exl3::testing {

namespace fs = std::filesystem;

namespace {

void AddLinear(SafetensorsWriter& w, const std::string& prefix, int in, int out, int K, int cb,
               std::mt19937& rng) {
  std::vector<uint16_t> trellis(static_cast<size_t>(in / 16) * (out / 16) * 16 * K);
  for (auto& v : trellis) v = static_cast<uint16_t>(rng());
  w.Add(prefix + ".trellis", DType::kI16, {in / 16, out / 16, 16 * K}, trellis.data(),
        trellis.size() * 2);
  // Scales keep activations O(1): |W| ~ 1.24 * suh * svh, sums over `in` terms.
  std::uniform_real_distribution<float> mag(0.5f, 1.5f);
  auto scales = [&](int n, float base) {
    std::vector<uint16_t> s(n);
    for (auto& v : s) {
      const float x = base * mag(rng) * ((rng() & 1) ? 1.0f : -1.0f);
      v = FloatToHalfBits(x);
    }
    return s;
  };
  const float base = 1.0f / std::sqrt(std::sqrt(static_cast<float>(in)));
  std::vector<uint16_t> suh = scales(in, base), svh = scales(out, base);
  w.Add(prefix + ".suh", DType::kF16, {in}, suh.data(), suh.size() * 2);
  w.Add(prefix + ".svh", DType::kF16, {out}, svh.data(), svh.size() * 2);
  if (cb == 1) {
    const int32_t v = static_cast<int32_t>(0xCBAC1FEDu);
    w.Add(prefix + ".mcg", DType::kI32, {}, &v, 4);
  } else if (cb == 2) {
    const int32_t v = static_cast<int32_t>(0x83DCD12Du);
    w.Add(prefix + ".mul1", DType::kI32, {}, &v, 4);
  }
}

}  // namespace

absl::Status WriteTestModel(const std::string& dir, const TestModelSpec& s) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  {
    std::ofstream cfg(fs::path(dir) / "config.json");
    cfg << "{\n"
        << "  \"architectures\": [\"Glm4MoeForCausalLM\"],\n"
        << "  \"model_type\": \"glm4_moe\",\n"
        << "  \"hidden_size\": " << s.hidden << ",\n"
        << "  \"intermediate_size\": " << 2 * s.hidden << ",\n"
        << "  \"num_hidden_layers\": " << s.layers << ",\n"
        << "  \"first_k_dense_replace\": 1,\n"
        << "  \"n_routed_experts\": " << s.experts << ",\n"
        << "  \"num_experts_per_tok\": " << s.top_k << ",\n"
        << "  \"moe_intermediate_size\": " << s.intermediate << ",\n"
        << "  \"n_shared_experts\": 0,\n"
        << "  \"norm_topk_prob\": true,\n"
        << "  \"routed_scaling_factor\": 1.0,\n"
        << "  \"n_group\": 1,\n"
        << "  \"topk_group\": 1,\n"
        << "  \"quantization_config\": {\"quant_method\": \"exl3\", \"version\": \"0.0.1\", "
           "\"bits\": 3.0, \"head_bits\": 6}\n"
        << "}\n";
    if (!cfg) return absl::InternalError(absl::StrCat("cannot write ", dir, "/config.json"));
  }
  std::mt19937 rng(s.seed);
  SafetensorsWriter w;
  const char* proj[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int layer = 1; layer < s.layers; ++layer) {
    for (int e = 0; e < s.experts; ++e) {
      if (std::find(s.skip_experts.begin(), s.skip_experts.end(), e) != s.skip_experts.end()) continue;
      for (int p = 0; p < 3; ++p) {
        const int in = p < 2 ? s.hidden : s.intermediate;
        const int out = p < 2 ? s.intermediate : s.hidden;
        const int K = 2 + (layer + e + p) % 3;   // 2..4
        const int cb = (layer * 7 + e + p) % 3;  // 3INST, MCG, MUL1
        AddLinear(w, absl::StrCat("model.layers.", layer, ".mlp.experts.", e, ".", proj[p]), in,
                  out, K, cb, rng);
      }
    }
    // Router weights (fp32) and correction bias, as a GLM checkpoint has them.
    std::vector<float> gate(static_cast<size_t>(s.experts) * s.hidden);
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (auto& v : gate) v = nd(rng);
    w.AddF32(absl::StrCat("model.layers.", layer, ".mlp.gate.weight"), {s.experts, s.hidden},
             gate.data());
    std::vector<float> bias(s.experts);
    for (auto& v : bias) v = nd(rng);
    w.AddF32(absl::StrCat("model.layers.", layer, ".mlp.gate.e_score_correction_bias"),
             {s.experts}, bias.data());
  }
  return w.Write((fs::path(dir) / "model.safetensors").string());
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(base ? base : "/tmp", "/exl3svc-XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back(0);
  if (mkdtemp(buf.data()) == nullptr) std::abort();
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return 0;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

std::vector<float> RandomHidden(std::mt19937& rng, int T, int H) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * H);
  for (auto& v : x) v = nd(rng);
  return x;
}

void RandomRouting(std::mt19937& rng, int T, int S, const std::vector<int>& experts, int max_used,
                   std::vector<int32_t>* ids, std::vector<float>* weights) {
  ids->assign(static_cast<size_t>(T) * S, -1);
  weights->assign(static_cast<size_t>(T) * S, 0.0f);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (int t = 0; t < T; ++t) {
    std::vector<int> pool = experts;
    std::shuffle(pool.begin(), pool.end(), rng);
    const int used = std::min<int>({S, max_used, static_cast<int>(pool.size())});
    const int n = used > 0 ? 1 + static_cast<int>(rng() % used) : 0;
    std::vector<int> slots(S);
    for (int s = 0; s < S; ++s) slots[s] = s;
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int i = 0; i < n; ++i) {
      (*ids)[static_cast<size_t>(t) * S + slots[i]] = pool[i];
      (*weights)[static_cast<size_t>(t) * S + slots[i]] = wd(rng);
    }
  }
}

::exl3serve::v1::ExpertRequest MakeRequest(uint64_t id, int layer, const std::vector<float>& x,
                                           int T, int H, int S, const std::vector<int32_t>& ids,
                                           const std::vector<float>& weights) {
  ::exl3serve::v1::ExpertRequest r;
  r.set_id(id);
  r.set_layer(layer);
  svc::EncodeTensor(x.data(), {T, H}, ::exl3serve::v1::DTYPE_FP32, r.mutable_hidden());
  r.set_slots(S);
  for (int32_t v : ids) r.add_expert_ids(v);
  for (float v : weights) r.add_expert_weights(v);
  return r;
}

std::vector<float> OutputAsFloat(const ::exl3serve::v1::ExpertResponse& r) {
  const auto& t = r.output();
  size_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<size_t>(d);
  std::vector<float> out(n);
  if (!svc::ValidateTensor(t, "output", std::vector<int64_t>(t.shape_size(), -1)).ok()) return {};
  if (!svc::TensorToFloat(t, "output", false, out.data()).ok()) return {};
  return out;
}

}  // namespace exl3::testing
