#include "tests/services/expert_worker/worker_harness.h"

#include <cmath>
#include <filesystem>

#include "gtest/gtest.h"
#include "kernels/moe_cpu.h"

namespace exl3::testing {

worker::WorkerOptions WorkerHarness::Options() {
  if (!std::filesystem::exists(model_dir() + "/config.json")) {
    absl::Status s = WriteExpertModel(model_dir(), spec);
    EXPECT_TRUE(s.ok()) << s;
  }
  worker::WorkerOptions o;
  o.model_dir = model_dir();
  o.experts = "0-5";
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";  // no HTTP endpoint: civetweb takes 2 s to stop (scripts/checks scrape it)
  o.backend = "cpu";
  o.threads = 2;
  o.load_threads = 2;
  o.progress = false;
  return o;
}

void WorkerHarness::Start(const worker::WorkerOptions& opt, bool load) {
  absl::StatusOr<std::unique_ptr<worker::WorkerServer>> w = worker::WorkerServer::Create(opt);
  ASSERT_TRUE(w.ok()) << w.status();
  server = std::move(*w);
  if (load) {
    absl::Status s = server->Load();
    ASSERT_TRUE(s.ok()) << s;
  }
  channel = LoopbackChannel(server->address());
  stub = pb::ExpertWorker::NewStub(channel);
}

std::vector<float> WorkerHarness::Reference(int layer, const std::vector<float>& x, int T, int S,
                                            const std::vector<int32_t>& ids,
                                            const std::vector<float>& w) {
  if (!reference) {
    auto m = Exl3Model::Open(model_dir());
    EXPECT_TRUE(m.ok()) << m.status();
    reference = std::move(*m);
  }
  absl::StatusOr<MoeLayerView> v = reference->LayerView(layer);
  EXPECT_TRUE(v.ok()) << v.status();
  std::vector<int32_t> offsets{0}, cids;
  std::vector<float> cw;
  for (int t = 0; t < T; ++t) {
    for (int s = 0; s < S; ++s) {
      if (ids[t * S + s] < 0) continue;
      cids.push_back(ids[t * S + s]);
      cw.push_back(w[t * S + s]);
    }
    offsets.push_back(static_cast<int32_t>(cids.size()));
  }
  MoeAssignments a{T, cids.data(), cw.data(), offsets.data(), 0};
  std::vector<float> y(static_cast<size_t>(T) * v->hidden_size);
  absl::Status s = MoeForwardReference(*v, x.data(), a, /*include_shared=*/false, y.data());
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

grpc::Status RunStream(pb::ExpertWorker::Stub* stub, const std::vector<pb::ExpertRequest>& reqs,
                       std::vector<pb::ExpertResponse>* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->Forward(&ctx);
  for (const auto& r : reqs) {
    if (!stream->Write(r)) break;
  }
  stream->WritesDone();
  pb::ExpertResponse resp;
  while (stream->Read(&resp)) out->push_back(resp);
  return stream->Finish();
}

double RelError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, static_cast<double>(std::fabs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::fabs(b[i])));
  }
  return den > 0 ? num / den : num;
}

}  // namespace exl3::testing
