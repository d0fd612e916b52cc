#include "tests/services/common/service_test_util.h"

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
