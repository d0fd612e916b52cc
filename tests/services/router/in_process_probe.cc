// exl3-in-process-probe MODEL_DIR MAP: drives an InProcessRouter (services/router/in_process_router.h)
// over real workers with a few requests whose answers must come in-band, and prints one line per
// case, "CASE CODE" (gRPC code name of the in-band status, or of the callback's status when there
// was no answer), for in_process_test.py:
//   bad_layer     layer 0 (not an MoE layer): NOT_FOUND
//   bad_shape     a hidden tensor whose data does not match its shape: INVALID_ARGUMENT
//   good          one token on the first MoE layer: OK
//   routed        RouterMoeExecutor (services/router/router_moe_executor.h): 3 tokens with the
//                 experts chosen by the caller (StartRouted, the GPU engine's device gate) against
//                 the router's own gate (Start): OK when the answers are equal
//   routed_bad    StartRouted with an expert id past the model's: INVALID_ARGUMENT
//   cancel        a request withdrawn with CancelRequest before it could be answered, with every
//                 worker paused by the test (SIGSTOP): CANCELLED (only with --cancel)
#include <cmath>
#include <cstdio>
#include <future>
#include <string>
#include <vector>

#include "services/client/moe_client.h"
#include "services/common/status.h"
#include "services/router/gate.h"
#include "services/router/in_process_router.h"
#include "services/router/router_moe_executor.h"

namespace exl3 {
namespace {

namespace pb = ::exl3serve::v1;

std::string Run(client::LayerStream& s, pb::MoeLayerRequest req) {
  std::promise<std::string> done;
  absl::Status st = s.Send(req, [&](absl::Status st, const pb::MoeLayerResponse* r) {
    if (st.ok() && r) st = svc::FromRequestStatus(r->status());
    done.set_value(svc::StatusCodeName(st.code()));
  });
  if (!st.ok()) return "SEND_FAILED " + std::string(st.message());
  return done.get_future().get();
}

// The "routed" and "routed_bad" cases: 3 tokens of varied hidden states on layer L.
std::string Routed(router::InProcessRouter& r, int L, bool bad_expert) {
  const Exl3Model& model = r.core().model();
  const int H = model.config().hidden_size, T = 3;
  std::vector<float> x(static_cast<size_t>(T) * H);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.05f * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  router::GateInput in;
  in.layer = L;
  in.num_tokens = T;
  router::Gate gate(model, /*threads=*/1);
  absl::StatusOr<router::Routing> routing = gate.Route(std::move(in), x.data());
  if (!routing.ok()) return "GATE_FAILED " + std::string(routing.status().message());
  if (bad_expert) routing->ids[1] = model.config().num_experts;
  router::RouterMoeExecutor executor(r.core().service(), /*inline_max_tokens=*/64, H, std::chrono::seconds(30));
  std::vector<float> routed(x.size()), gated(x.size());
  const engine::MoeRouting given{routing->k, routing->ids.data(), routing->weights.data()};
  const absl::Status st = executor.StartRouted(L, x.data(), T, given, routed.data())->Wait();
  if (!st.ok() || bad_expert) return svc::StatusCodeName(st.code());
  const absl::Status own = executor.Start(L, x.data(), T, /*token_ids=*/nullptr, gated.data())->Wait();
  if (!own.ok()) return "OWN_GATE " + svc::StatusCodeName(own.code());
  return routed == gated ? "OK" : "DIFFERENT";
}

int Main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: exl3-in-process-probe MODEL_DIR MAP [--cancel]\n");
    return 2;
  }
  const bool cancel = argc > 3 && std::string(argv[3]) == "--cancel";
  router::InProcessRouterOptions o;
  o.core.model_dir = argv[1];
  o.core.expert_map_path = argv[2];
  auto r = router::InProcessRouter::Create(o);
  if (!r.ok()) {
    std::fprintf(stderr, "exl3-in-process-probe: %s\n", std::string(r.status().message()).c_str());
    return 2;
  }
  const MoeConfig& cfg = (*r)->core().model().config();
  const int H = cfg.hidden_size, L = cfg.MoeLayers().front();
  std::vector<float> x(H, 0.5f);
  std::unique_ptr<router::InProcessStream> s = (*r)->OpenStream();

  std::printf("bad_layer %s\n", Run(*s, client::MakeLayerRequest(0, x.data(), 1, H, pb::DTYPE_FP32)).c_str());
  pb::MoeLayerRequest bad = client::MakeLayerRequest(L, x.data(), 1, H, pb::DTYPE_FP32);
  bad.mutable_hidden()->set_shape(0, 2);  // says 2 tokens, carries 1
  std::printf("bad_shape %s\n", Run(*s, bad).c_str());
  std::printf("good %s\n", Run(*s, client::MakeLayerRequest(L, x.data(), 1, H, pb::DTYPE_FP32)).c_str());
  std::printf("routed %s\n", Routed(**r, L, /*bad_expert=*/false).c_str());
  std::printf("routed_bad %s\n", Routed(**r, L, /*bad_expert=*/true).c_str());
  std::fflush(stdout);
  if (cancel) {
    // The test pauses the workers once it reads this line, then presses on (stdin).
    std::printf("paused?\n");
    std::fflush(stdout);
    (void)std::getchar();
    std::promise<std::string> done;
    pb::MoeLayerRequest req = client::MakeLayerRequest(L, x.data(), 1, H, pb::DTYPE_FP32);
    absl::Status st = s->Send(req, [&](absl::Status st, const pb::MoeLayerResponse* resp) {
      if (st.ok() && resp) st = svc::FromRequestStatus(resp->status());
      done.set_value(svc::StatusCodeName(st.code()));
    });
    if (st.ok()) st = s->CancelRequest(req.id());
    std::printf("cancel %s\n", st.ok() ? done.get_future().get().c_str() : "SEND_FAILED");
  }
  std::printf("in_flight %d\n", s->in_flight());
  absl::Status cs = s->Close();
  std::printf("close %s\n", svc::StatusCodeName(cs.code()).c_str());
  return 0;
}

}  // namespace
}  // namespace exl3

int main(int argc, char** argv) { return exl3::Main(argc, argv); }
