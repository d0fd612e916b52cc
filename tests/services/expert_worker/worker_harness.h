// An in-process exl3 expert worker on loopback serving a generated test model, plus the CPU
// reference MoE of the same model for checking its answers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "model/exl3_model.h"
#include "services/expert_worker/worker_server.h"
#include "tests/services/common/grpc_test_util.h"
#include "tests/services/common/service_test_util.h"
#include "tools/test_model/expert_test_model.h"

namespace exl3::testing {

namespace pb = ::exl3serve::v1;

struct WorkerHarness {
  TempDir dir;
  ExpertModelSpec spec = ServiceModelSpec();
  std::unique_ptr<worker::WorkerServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::ExpertWorker::Stub> stub;
  std::unique_ptr<Exl3Model> reference;  // every expert

  std::string model_dir() const { return dir.path() + "/model"; }
  // Writes the model (once) and options pointing at it: experts 0-5 of 8, loopback, port 0.
  worker::WorkerOptions Options();
  // Creates (and with `load`, loads) the server; connects the stub.
  void Start(const worker::WorkerOptions& opt, bool load = true);

  // The reference output for a request [T, hidden] with padded routing [T, S].
  std::vector<float> Reference(int layer, const std::vector<float>& x, int T, int S,
                               const std::vector<int32_t>& ids, const std::vector<float>& w);
};

// Sends `reqs` on one new stream (all written first, then WritesDone), returns the responses
// by arrival and the stream's final status.
grpc::Status RunStream(pb::ExpertWorker::Stub* stub, const std::vector<pb::ExpertRequest>& reqs,
                       std::vector<pb::ExpertResponse>* out);

// max |a - b| / max(|b|)
double RelError(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace exl3::testing
