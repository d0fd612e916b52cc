// exl3-engine-bench --attention-only: the GPU engine's attention kernels alone
// (engine/cuda/attention_kernels.h) on random inputs of one model shape, each against its floor
// measured in the same run: decode (one query token per sequence, every sequence its own blocks)
// against the KV bytes it must read over the copy bandwidth, prefill (a prompt in chunks, each
// chunk reading the earlier chunks' keys from the cache) against its causal FLOPs at the cuBLAS
// fp16 rate, and beside it the same chunks through the decode kernel.
#pragma once

#include <cstdio>
#include <vector>

namespace exl3::bench {

struct AttentionBenchOptions {
  int num_heads = 96, num_kv_heads = 8, head_dim = 128;  // GLM-4.5-Air
  std::vector<int> batches = {1, 8, 64};
  std::vector<int> contexts = {1024, 8192};  // decode contexts and prefill prompt lengths
  int prefill_chunk = 2048;
  int runs = 30;                              // timed runs per case (median), after warm-up
  FILE* json = nullptr;                       // one JSON object per result, or null
};

// Prints one table; copy_bytes_per_s and gemm_flops_per_s: the floors' rates measured in this run.
// Returns a process exit code.
int RunAttentionBench(const AttentionBenchOptions& options, double copy_bytes_per_s, double gemm_flops_per_s);

}  // namespace exl3::bench
