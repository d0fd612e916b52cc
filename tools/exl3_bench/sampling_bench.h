// exl3-engine-bench --sampling-only: the cost per step of sampling a step's logit rows, on the
// device (engine/cuda/device_sampler.h: the rows' parameters up, one kernel, the tokens down) and
// the old way beside it (every logit row copied to the host, then the CPU sampler,
// engine/sampling/sampler.h, on one thread as the engine's default sampling_threads is), on random logits
// of one vocabulary for each batch of rows, greedy and with top-k + top-p + penalties.
#pragma once

#include <cstdio>
#include <vector>

namespace exl3::bench {

struct SamplingBenchOptions {
  int vocab = 151552;  // GLM-4.5-Air
  std::vector<int> batches = {1, 8, 64};
  int prompt_tokens = 1024;  // history the penalties look at, per row
  int output_tokens = 128;
  int runs = 30;             // timed runs per case (median), after warm-up
  FILE* json = nullptr;      // one JSON object per result, or null
};

// Prints one table. Returns a process exit code.
int RunSamplingBench(const SamplingBenchOptions& options);

}  // namespace exl3::bench
