// The combine of a layer call (services/router/layer_call.h): the workers' partial sums and the
// local shared expert added in fp32 as they come, and the answer built once the call ends (output
// in the requested dtype, the routing used, RouterTimings).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/exl3_model.h"
#include "services/router/layer_call.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

// Adds a worker's answer to a part into the call's sum: row r of `output` is the call's row
// rows[r]. INTERNAL naming `worker` when the output is not [rows, H] of a wire dtype. Nothing is
// added once the call has ended.
absl::Status AddWorkerOutput(LayerCall& c, const std::vector<int32_t>& rows,
                             const pb::Tensor& output, const std::string& worker);

// The shared expert on the router's CPU (--shared-expert local), run while the workers compute.
class LocalSharedExpert {
 public:
  // `model` (with its shared experts loaded) must outlive this.
  LocalSharedExpert(const Exl3Model& model, int threads);
  // Adds the layer's shared expert of every row of the call into its sum.
  absl::Status AddTo(LayerCall& c);

 private:
  const Exl3Model& model_;
  cpu::CpuBackend cpu_;
};

// An upper bound of the answer's serialized size: output, top-k ids (varints of at most 5 bytes)
// and weights, and 256 bytes for id, layer, status and timings.
size_t AnswerBytesBound(int64_t num_tokens, int hidden_size, pb::DType out_dtype, int k);

struct LayerAnswer {
  pb::MoeLayerResponse response;
  Clock::time_point t_combine, t_end;  // when building it began and ended
};
// The answer of an ended call: with `st` OK the sum in the requested dtype (no output when the
// sum is in the caller's buffer, LayerCall::sum_out), the routing and the stage timings; else the
// status alone (and the timings that apply).
LayerAnswer MakeAnswer(const LayerCall& c, const absl::Status& st);

}  // namespace exl3::router
