#include "tools/exl3_bench/sampling_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/device_array.h"
#include "engine/cuda/device_sampler.h"
#include "engine/cuda/pinned_buffer.h"
#include "engine/sampling/sampler.h"

namespace exl3::bench {
namespace {

using exl3::engine::RowSampling;
using exl3::engine::SampledToken;
using exl3::engine::Sampler;
using exl3::engine::SamplingParams;
using exl3::engine::cuda::DeviceArray;
using exl3::engine::cuda::DeviceSampler;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Config {
  const char* name;
  SamplingParams params;
};

}  // namespace

int RunSamplingBench(const SamplingBenchOptions& o) {
  SamplingParams greedy;
  greedy.temperature = 0;
  SamplingParams full;
  full.temperature = 0.7f;
  full.top_k = 50;
  full.top_p = 0.9f;
  full.repetition_penalty = 1.1f;
  full.presence_penalty = 0.2f;
  full.frequency_penalty = 0.1f;
  const Config configs[] = {{"greedy", greedy}, {"top-k 50 + top-p 0.9 + penalties", full}};
  const int max_rows = *std::max_element(o.batches.begin(), o.batches.end());
  if (o.vocab < 1 || max_rows < 1 || o.runs < 1) {
    std::fprintf(stderr, "exl3-engine-bench --sampling-only: vocab, batches and runs must be positive\n");
    return 2;
  }

  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int32_t> token(0, o.vocab - 1);
  std::vector<float> logits(static_cast<size_t>(max_rows) * o.vocab);
  for (float& x : logits) x = normal(rng);
  std::vector<std::vector<int32_t>> prompts(max_rows), outputs(max_rows);
  for (int r = 0; r < max_rows; ++r) {
    prompts[r].resize(o.prompt_tokens);
    for (int32_t& t : prompts[r]) t = token(rng);
    outputs[r].resize(o.output_tokens);
    for (int32_t& t : outputs[r]) t = token(rng) % 4096;  // repeats: counts above 1
  }
  DeviceArray<float> d_logits, d_work;
  if (!d_logits.Upload(logits).ok() || !d_work.Reserve(logits.size()).ok()) {
    std::fprintf(stderr, "exl3-engine-bench --sampling-only: device allocation failed\n");
    return 1;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  DeviceSampler device(o.vocab);
  Sampler host(o.vocab);
  std::vector<float> host_logits(logits.size());  // pageable, as the engine's logits_ buffer

  std::printf("sampling per step, vocab %d, history %d prompt + %d output tokens per row, median of %d\n", o.vocab,
              o.prompt_tokens, o.output_tokens, o.runs);
  std::printf("%-34s %5s %14s %14s | %14s %14s %14s\n", "config", "rows", "device us", "device+host us",
              "old D2H us", "old sample us", "old total us");
  for (const Config& c : configs) {
    for (int rows : o.batches) {
      std::vector<RowSampling> rs(rows);
      for (int r = 0; r < rows; ++r) {
        rs[r].params = c.params;
        rs[r].seed = 100 + r;
        rs[r].history.prompt = prompts[r];
        rs[r].history.output = outputs[r];
      }
      std::vector<SampledToken> tokens(rows);
      const size_t n = static_cast<size_t>(rows) * o.vocab;
      std::vector<double> device_s, wall_s, copy_s, sample_s;
      for (int run = 0; run < o.runs + 3; ++run) {
        // The kernel overwrites penalized logits: every run starts from a fresh copy (untimed).
        cudaMemcpyAsync(d_work.get(), d_logits.get(), n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
        cudaStreamSynchronize(stream);
        const double t0 = Now();
        cudaEventRecord(start, stream);
        const absl::Status st = device.Launch(d_work.get(), rs, stream);
        cudaEventRecord(stop, stream);
        cudaStreamSynchronize(stream);
        device.Collect(tokens);
        const double t1 = Now();
        if (!st.ok()) {
          std::fprintf(stderr, "exl3-engine-bench --sampling-only: %s\n", std::string(st.message()).c_str());
          return 1;
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);

        // The old path: the logit rows to the host, then the CPU sampler.
        cudaMemcpyAsync(d_work.get(), d_logits.get(), n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
        cudaStreamSynchronize(stream);
        cudaEventRecord(start, stream);
        cudaMemcpyAsync(host_logits.data(), d_work.get(), n * sizeof(float), cudaMemcpyDeviceToHost, stream);
        cudaEventRecord(stop, stream);
        cudaStreamSynchronize(stream);
        float copy_ms = 0;
        cudaEventElapsedTime(&copy_ms, start, stop);
        const double t2 = Now();
        for (int r = 0; r < rows; ++r) {
          host.Sample(std::span<float>(host_logits).subspan(static_cast<size_t>(r) * o.vocab, o.vocab), rs[r].params,
                      rs[r].seed, rs[r].history);
        }
        const double t3 = Now();
        if (run < 3) continue;  // warm-up
        device_s.push_back(ms * 1e-3);
        wall_s.push_back(t1 - t0);
        copy_s.push_back(copy_ms * 1e-3);
        sample_s.push_back(t3 - t2);
      }
      const double d = Median(device_s), w = Median(wall_s), cp = Median(copy_s), sm = Median(sample_s);
      std::printf("%-34s %5d %14.1f %14.1f | %14.1f %14.1f %14.1f\n", c.name, rows, d * 1e6, w * 1e6, cp * 1e6,
                  sm * 1e6, (cp + sm) * 1e6);
      if (o.json)
        std::fprintf(o.json,
                     "{\"bench\":\"sampling\",\"config\":\"%s\",\"rows\":%d,\"vocab\":%d,\"device_s\":%.9f,"
                     "\"device_wall_s\":%.9f,\"old_copy_s\":%.9f,\"old_host_sample_s\":%.9f}\n",
                     c.name, rows, o.vocab, d, w, cp, sm);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace exl3::bench
