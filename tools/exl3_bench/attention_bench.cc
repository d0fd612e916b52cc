#include "tools/exl3_bench/attention_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"

namespace exl3::bench {
namespace {

using engine::cuda::AttentionScratchFloats;
using engine::cuda::AttentionTokens;
using engine::cuda::DeviceArray;
using engine::cuda::KvHalf;

constexpr int kBlockSize = 16;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A buffer larger than the L2 cache, rewritten before every timed run so no run finds the previous
// run's keys in L2.
class L2Flush {
 public:
  L2Flush() { cudaMalloc(&buffer_, kBytes); }
  ~L2Flush() { cudaFree(buffer_); }
  void Run() { cudaMemsetAsync(buffer_, 0, kBytes); }

 private:
  static constexpr size_t kBytes = 256 << 20;
  void* buffer_ = nullptr;
};

// Median device time (seconds) of `runs` runs of launch() after 2 warm-ups, L2 flushed before each.
template <typename Launch>
double TimeKernel(int runs, L2Flush& flush, Launch launch, bool* ok) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int i = 0; i < runs + 2; ++i) {
    flush.Run();
    cudaEventRecord(start);
    *ok = *ok && launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) times.push_back(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  *ok = *ok && cudaGetLastError() == cudaSuccess;
  return Median(times);
}

std::vector<float> RandomFloats(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A cache of `blocks` blocks of random fp16 keys and values (written through WriteKv, 4096 slots at
// a time).
bool FillCache(DeviceArray<KvHalf>& cache, int blocks, int kv_floats, std::mt19937& rng) {
  const size_t slots = static_cast<size_t>(blocks) * kBlockSize;
  if (!cache.Reserve(slots * 2 * kv_floats).ok()) return false;
  const int batch = 4096;
  DeviceArray<float> k, v;
  DeviceArray<int32_t> slot;
  if (!k.Upload(RandomFloats(static_cast<size_t>(batch) * kv_floats, rng)).ok() ||
      !v.Upload(RandomFloats(static_cast<size_t>(batch) * kv_floats, rng)).ok())
    return false;
  std::vector<int32_t> ids(batch);
  for (size_t s0 = 0; s0 < slots; s0 += batch) {
    const int n = static_cast<int>(std::min<size_t>(batch, slots - s0));
    for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(s0 + i);
    if (!slot.Upload(ids.data(), n).ok()) return false;
    if (!engine::cuda::WriteKv(k.get(), v.get(), slot.get(), n, kv_floats, cache.get(), nullptr).ok()) return false;
  }
  return cudaDeviceSynchronize() == cudaSuccess;
}

}  // namespace

int RunAttentionBench(const AttentionBenchOptions& o, double copy_bps, double gemm_flops) {
  const int NH = o.num_heads, KV = o.num_kv_heads, D = o.head_dim, kv_floats = KV * D;
  if (KV <= 0 || NH % KV != 0 || o.runs < 1 || o.prefill_chunk < 1) {
    std::fprintf(stderr, "exl3-engine-bench --attention-only: bad shape or counts\n");
    return 2;
  }
  if (exl3::cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "exl3-engine-bench --attention-only: no GPU visible\n");
    return 1;
  }
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::mt19937 rng(11);
  L2Flush flush;
  std::printf("attention kernels: %d query / %d KV heads of %d, fp16 KV cache in blocks of %d, %d SMs; "
              "median of %d runs, L2 flushed before each\n", NH, KV, D, kBlockSize, sms, o.runs);
  std::printf("floors: KV bytes / %.2f TB/s copy bandwidth; causal FLOPs / %.0f TFLOP/s cuBLAS fp16\n\n",
              copy_bps * 1e-12, gemm_flops * 1e-12);

  // Decode: B sequences of `context` cached positions, each its own blocks, one query token each.
  std::printf("%-8s %6s %8s %6s %12s %12s %8s %10s\n", "decode", "batch", "context", "splits", "time", "KV floor",
              "x floor", "KV GB/s");
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const int max_context = *std::max_element(o.contexts.begin(), o.contexts.end());
  const int max_blocks_per_seq = (max_context + 1 + kBlockSize - 1) / kBlockSize;
  DeviceArray<KvHalf> cache;
  if (!FillCache(cache, std::max(max_batch * max_blocks_per_seq, (max_context + kBlockSize - 1) / kBlockSize + 1),
                 kv_floats, rng)) {
    std::fprintf(stderr, "exl3-engine-bench --attention-only: KV cache allocation or fill failed\n");
    return 1;
  }
  bool ok = true;
  for (int context : o.contexts) {
    for (int B : o.batches) {
      const int bps = (context + 1 + kBlockSize - 1) / kBlockSize;
      std::vector<int32_t> pos(B, context), first(B, 0), offset(B), tables(static_cast<size_t>(B) * bps);
      for (int b = 0; b < B; ++b) offset[b] = b * bps;
      std::iota(tables.begin(), tables.end(), 0);
      // The split count the engine's decode graphs choose (engine/cuda/cuda_model.cc).
      const int splits = std::max(1, std::min(64, (2 * sms + B * KV - 1) / (B * KV)));
      const int span = context + 1;
      DeviceArray<int32_t> d_pos, d_first, d_offset, d_tables, d_sp;
      DeviceArray<float> q, out, scratch;
      ok = ok && d_pos.Upload(pos).ok() && d_first.Upload(first).ok() && d_offset.Upload(offset).ok() &&
           d_tables.Upload(tables).ok() && d_sp.Upload(std::vector<int32_t>{(span + splits - 1) / splits}).ok() &&
           q.Upload(RandomFloats(static_cast<size_t>(B) * NH * D, rng)).ok() &&
           out.Reserve(static_cast<size_t>(B) * NH * D).ok() &&
           scratch.Reserve(AttentionScratchFloats(B, NH, D, splits)).ok();
      if (!ok) break;
      const AttentionTokens at{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), kBlockSize};
      const double t = TimeKernel(o.runs, flush, [&] {
        return engine::cuda::PagedAttention(q.get(), cache.get(), at, B, NH, KV, D, scale, splits, d_sp.get(),
                                            scratch.get(), out.get(), nullptr).ok();
      }, &ok);
      const double bytes = static_cast<double>(B) * span * 2 * kv_floats * sizeof(KvHalf);
      const double floor_s = bytes / copy_bps;
      std::printf("%-8s %6d %8d %6d %9.1f us %9.1f us %8.2f %10.0f\n", "", B, context, splits, t * 1e6,
                  floor_s * 1e6, t / floor_s, bytes / t * 1e-9);
      if (o.json)
        std::fprintf(o.json, "{\"bench\":\"attention_decode\",\"batch\":%d,\"context\":%d,\"splits\":%d,\"time_s\":%.9f,"
                     "\"floor_s\":%.9f,\"kv_bytes\":%.0f}\n", B, context, splits, t, floor_s, bytes);
      // Other split counts (to check the engine's choice), at batches where several fill the GPU.
      if (B <= 8) {
        std::printf("%-8s   splits:", "");
        for (int sweep : {2, 4, 8, 16, 32, 64}) {
          if (sweep == splits || !d_sp.Upload(std::vector<int32_t>{(span + sweep - 1) / sweep}).ok() ||
              !scratch.Reserve(AttentionScratchFloats(B, NH, D, sweep)).ok())
            continue;
          const double ts = TimeKernel(o.runs, flush, [&] {
            return engine::cuda::PagedAttention(q.get(), cache.get(), at, B, NH, KV, D, scale, sweep, d_sp.get(),
                                                scratch.get(), out.get(), nullptr).ok();
          }, &ok);
          std::printf(" %d:%.1fus", sweep, ts * 1e6);
        }
        std::printf("\n");
      }
    }
  }

  // Prefill: one prompt in chunks; chunk c attends to the earlier chunks' positions in the cache.
  std::printf("\n%-8s %6s %8s %12s %12s %8s %10s %16s\n", "prefill", "prompt", "chunk", "time", "FLOP floor",
              "x floor", "TFLOP/s", "decode kernel");
  const bool prefill_kernel = engine::cuda::PrefillAttentionSupports(D);
  for (int prompt : o.contexts) {
    const int blocks = (prompt + kBlockSize - 1) / kBlockSize;
    std::vector<int32_t> tables(blocks);
    std::iota(tables.begin(), tables.end(), 0);
    DeviceArray<int32_t> d_tables;
    ok = ok && d_tables.Upload(tables).ok();
    double total = 0, total_decode = 0, flops = 0;
    for (int start = 0; start < prompt && ok; start += o.prefill_chunk) {
      const int n = std::min(o.prefill_chunk, prompt - start);
      std::vector<int32_t> pos(n), first(n, 0), offset(n, 0);
      std::iota(pos.begin(), pos.end(), start);
      for (int i = 0; i < n; ++i) flops += 4.0 * NH * D * (start + i + 1);
      // The engine's eager split count for a chunk of n tokens (CudaModel::SplitsFor): 1 here.
      const int splits = 1;
      DeviceArray<int32_t> d_pos, d_first, d_offset, d_sp;
      DeviceArray<float> q, out, scratch;
      ok = d_pos.Upload(pos).ok() && d_first.Upload(first).ok() && d_offset.Upload(offset).ok() &&
           d_sp.Upload(std::vector<int32_t>{start + n}).ok() &&
           q.Upload(RandomFloats(static_cast<size_t>(n) * NH * D, rng)).ok() &&
           out.Reserve(static_cast<size_t>(n) * NH * D).ok() &&
           scratch.Reserve(AttentionScratchFloats(n, NH, D, splits)).ok();
      if (!ok) break;
      const AttentionTokens at{d_pos.get(), d_first.get(), d_offset.get(), d_tables.get(), kBlockSize};
      if (prefill_kernel)
        total += TimeKernel(o.runs, flush, [&] {
          return engine::cuda::PrefillAttention(q.get(), cache.get(), at, n, NH, KV, D, scale, splits, d_sp.get(),
                                                scratch.get(), out.get(), nullptr).ok();
        }, &ok);
      total_decode += TimeKernel(std::max(1, o.runs / 10), flush, [&] {
        return engine::cuda::PagedAttention(q.get(), cache.get(), at, n, NH, KV, D, scale, splits, d_sp.get(),
                                            scratch.get(), out.get(), nullptr).ok();
      }, &ok);
    }
    const double floor_s = flops / gemm_flops;
    if (prefill_kernel) {
      std::printf("%-8s %6d %8d %9.3f ms %9.3f ms %8.2f %10.1f %13.3f ms\n", "", prompt, o.prefill_chunk, total * 1e3,
                  floor_s * 1e3, total / floor_s, flops / total * 1e-12, total_decode * 1e3);
    } else {
      std::printf("%-8s %6d %8d %12s %9.3f ms %8s %10s %13.3f ms  (head_dim %d: no prefill kernel)\n", "", prompt,
                  o.prefill_chunk, "-", floor_s * 1e3, "-", "-", total_decode * 1e3, D);
    }
    if (o.json)
      std::fprintf(o.json, "{\"bench\":\"attention_prefill\",\"prompt\":%d,\"chunk\":%d,\"time_s\":%.9f,"
                   "\"decode_kernel_time_s\":%.9f,\"floor_s\":%.9f,\"flops\":%.0f}\n", prompt, o.prefill_chunk,
                   prefill_kernel ? total : -1.0, total_decode, floor_s, flops);
  }
  if (!ok) {
    std::fprintf(stderr, "exl3-engine-bench --attention-only: a launch or allocation failed\n");
    return 1;
  }
  return 0;
}

}  // namespace exl3::bench
