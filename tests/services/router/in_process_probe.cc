// exl3-in-process-probe MODEL_DIR MAP: drives an InProcessRouter (services/router/in_process_router.h)
// over real workers with a few requests whose answers must come in-band, and prints one line per
// case, "CASE CODE" (gRPC code name of the in-band status, or of the callback's status when there
// was no answer), for in_process_test.py:
//   bad_layer     layer 0 (not an MoE layer): NOT_FOUND
//   bad_shape     a hidden tensor whose data does not match its shape: INVALID_ARGUMENT
//   good          one token on the first MoE layer: OK
//   cancel        a request withdrawn with CancelRequest before it could be answered, with every
//                 worker paused by the test (SIGSTOP): CANCELLED (only with --cancel)
#include <cstdio>
#include <future>
#include <string>
#include <vector>

#include "services/client/moe_client.h"
#include "services/common/status.h"
#include "services/router/in_process_router.h"

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
