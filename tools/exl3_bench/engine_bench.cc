// exl3-engine-bench: what users compare of the GPU engine (engine/cuda/cuda_model.h) on one model,
// with no scheduler or gRPC in the way: time to first token and prefill tokens/s of one prompt,
// then decode tokens/s at several batch sizes with every sequence continuing that prompt (its
// blocks shared, as prefix caching shares them), each beside its floor measured in the same run:
// per part of the step (attention, dense MLPs, head, the experts B tokens touch under uniform
// routing) the slower of reading its bytes at the device's copy bandwidth and decoding its EXL3
// weights at the measured decode ceiling, plus the routers, embeddings and fp16 KV cache read.
//
//   exl3-engine-bench --model DIR [--context 1024,8192] [--batch 1,8,32,64] [--steps 16]
//                     [--prefill-chunk 2048] [--no-graphs] [--max-moe-tokens N] [--json FILE]
//   exl3-engine-bench --attention-only [--attention-shape 96,8,128] [--context 1024,8192]
//                     [--batch 1,8,64] [--prefill-chunk 2048] [--runs 30] [--json FILE]
//   exl3-engine-bench --sampling-only [--vocab 151552] [--batch 1,8,64] [--runs 30] [--json FILE]
//
// --attention-only times the attention kernels alone (tools/exl3_bench/attention_bench.h);
// --sampling-only the sampling of a step's rows on the device and the old host path
// (tools/exl3_bench/sampling_bench.h).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "engine/cuda/cuda_model.h"
#include "kernels/cuda/bench_hooks.h"
#include "tools/exl3_bench/attention_bench.h"
#include "tools/exl3_bench/sampling_bench.h"

namespace {

using exl3::engine::KvCacheShape;
using exl3::engine::SequenceChunk;
using exl3::engine::StepBatch;
using exl3::engine::cuda::CudaModel;
using exl3::engine::cuda::CudaModelOptions;
using exl3::engine::cuda::DecodedWeights;

constexpr char kUsage[] =
    "usage: exl3-engine-bench --model DIR [--context 1024,8192] [--batch 1,8,32,64] [--steps 16]\n"
    "                         [--prefill-chunk 2048] [--no-graphs] [--max-moe-tokens N] [--json FILE]\n"
    "       exl3-engine-bench --attention-only [--attention-shape 96,8,128] [--context 1024,8192]\n"
    "                         [--batch 1,8,64] [--prefill-chunk 2048] [--runs 30] [--json FILE]\n"
    "       exl3-engine-bench --sampling-only [--vocab 151552] [--batch 1,8,64] [--runs 30] [--json FILE]\n"
    "\n"
    "Runs the GPU engine directly on DIR (an EXL3 model of a GQA family, experts on this GPU):\n"
    "time to first token and prefill tokens/s of one prompt of each --context length, then decode\n"
    "tokens/s at each --batch size continuing it, each against its floor (per part, the slower of\n"
    "its bytes over the copy bandwidth and its EXL3 weights over the decode ceiling, both measured\n"
    "in the same run). --no-graphs: decode steps launch eagerly instead of\n"
    "replaying CUDA graphs. --max-moe-tokens: the MoE workspace's token rows (CudaModelOptions).\n"
    "--json appends one JSON object per result.\n"
    "\n"
    "--attention-only: no model; the attention kernels alone on random inputs of --attention-shape\n"
    "(query heads, KV heads, head dim): decode at each --batch and --context against the KV-read\n"
    "floor, prefill of each --context prompt in --prefill-chunk chunks against the FLOP floor.\n"
    "\n"
    "--sampling-only: no model; sampling --batch rows of random logits of --vocab tokens per step,\n"
    "greedy and top-k 50 + top-p 0.9 + penalties: on the device (device-event time, and wall time\n"
    "with the host's packing and unpacking) beside the old path (the rows' device-to-host copy and\n"
    "the CPU sampler on one thread).\n";

std::vector<int> IntList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double CopyBandwidth() {
  const size_t bytes = size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess) return 0;
  cudaMemset(src, 0x5a, bytes);
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    cudaDeviceSynchronize();
    const double t0 = Now();
    cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    if (i >= 2) t.push_back(Now() - t0);
  }
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / Median(t);
}

// The EXL3 decode ceiling (weights/s) of every bit width and codebook the parts decode, measured
// as exl3-bench measures it (kernels/cuda/bench_hooks.h: each warp decodes register-resident
// words, nothing read from memory); 0 where no part has that width.
struct DecodeCeilings {
  double weights_per_s[9][3] = {};
};
DecodeCeilings MeasureDecodeCeilings(std::initializer_list<const DecodedWeights*> parts) {
  DecodeCeilings c;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int grid = sms * 8, block = 256, iters = 2048;
  uint32_t* seeds = nullptr;
  float* out = nullptr;
  if (cudaMalloc(&seeds, 1024 * 4) != cudaSuccess || cudaMalloc(&out, size_t(grid) * block * 4) != cudaSuccess) return c;
  std::vector<uint32_t> host_seeds(1024);
  std::mt19937 rng(11);
  for (auto& s : host_seeds) s = static_cast<uint32_t>(rng());
  cudaMemcpy(seeds, host_seeds.data(), 4096, cudaMemcpyHostToDevice);
  for (int K = 1; K <= 8; ++K)
    for (int cb = 0; cb < 3; ++cb) {
      bool used = false;
      for (const DecodedWeights* p : parts) used |= p->count[K][cb] > 0;
      if (!used) continue;
      std::vector<double> t;
      for (int i = 0; i < 6; ++i) {
        cudaDeviceSynchronize();
        const double t0 = Now();
        if (!exl3::cuda::RunDecodeCeiling(K, cb, seeds, out, iters, grid, block, nullptr).ok()) break;
        cudaDeviceSynchronize();
        if (i >= 1) t.push_back(Now() - t0);
      }
      if (!t.empty()) c.weights_per_s[K][cb] = double(grid) * (block / 32) * iters * 4 * 256 / Median(t);
    }
  cudaFree(seeds);
  cudaFree(out);
  return c;
}
// Seconds to decode `w` at the ceilings.
double DecodeSeconds(const DecodedWeights& w, const DecodeCeilings& c) {
  double s = 0;
  for (int K = 1; K <= 8; ++K)
    for (int cb = 0; cb < 3; ++cb)
      if (w.count[K][cb] > 0 && c.weights_per_s[K][cb] > 0) s += w.count[K][cb] / c.weights_per_s[K][cb];
  return s;
}

// cuBLAS fp16 GEMM (fp32 accumulate) on 8192^3, FLOP/s: the prefill floor's rate.
double CublasFp16Rate() {
  const int n = 8192;
  __half *a = nullptr, *b = nullptr;
  float* c = nullptr;
  if (cudaMalloc(&a, size_t(n) * n * 2) != cudaSuccess || cudaMalloc(&b, size_t(n) * n * 2) != cudaSuccess ||
      cudaMalloc(&c, size_t(n) * n * 4) != cudaSuccess)
    return 0;
  cudaMemset(a, 0x3c, size_t(n) * n * 2);  // 0x3c3c: about 1.06, finite
  cudaMemset(b, 0x3c, size_t(n) * n * 2);
  cublasHandle_t h;
  cublasCreate(&h);
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<double> t;
  for (int i = 0; i < 8; ++i) {
    cudaDeviceSynchronize();
    const double t0 = Now();
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16F, n, b, CUDA_R_16F, n, &beta, c,
                 CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    if (i >= 2) t.push_back(Now() - t0);
  }
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * n * double(n) / Median(t);
}

int Fail(const std::string& m) {
  std::fprintf(stderr, "exl3-engine-bench: %s\n", m.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, json;
  std::vector<int> contexts = {1024, 8192}, batches = {1, 8, 32, 64};
  int steps = 16, chunk = 2048, runs = 30, max_moe_tokens = 0;
  bool graphs = true, attention_only = false, sampling_only = false, batches_given = false;
  int sampling_vocab = 151552;
  std::vector<int> attention_shape = {96, 8, 128};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "exl3-engine-bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--model") {
      model = value();
    } else if (a == "--context") {
      contexts = IntList(value());
    } else if (a == "--batch") {
      batches = IntList(value());
      batches_given = true;
    } else if (a == "--attention-only") {
      attention_only = true;
    } else if (a == "--sampling-only") {
      sampling_only = true;
    } else if (a == "--vocab") {
      sampling_vocab = std::atoi(value());
    } else if (a == "--attention-shape") {
      attention_shape = IntList(value());
    } else if (a == "--runs") {
      runs = std::atoi(value());
    } else if (a == "--steps") {
      steps = std::atoi(value());
    } else if (a == "--prefill-chunk") {
      chunk = std::atoi(value());
    } else if (a == "--no-graphs") {
      graphs = false;
    } else if (a == "--max-moe-tokens") {
      max_moe_tokens = std::atoi(value());
    } else if (a == "--json") {
      json = value();
    } else {
      std::fprintf(stderr, "exl3-engine-bench: unknown argument %s\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (sampling_only) {
    exl3::bench::SamplingBenchOptions so;
    so.vocab = sampling_vocab;
    if (batches_given) so.batches = batches;
    so.runs = runs;
    so.json = json.empty() ? nullptr : std::fopen(json.c_str(), "a");
    const int rc = exl3::bench::RunSamplingBench(so);
    if (so.json) std::fclose(so.json);
    return rc;
  }
  if (attention_only) {
    if (attention_shape.size() != 3 || contexts.empty() || chunk < 1 || runs < 1) {
      std::fputs(kUsage, stderr);
      return 2;
    }
    exl3::bench::AttentionBenchOptions ao;
    ao.num_heads = attention_shape[0];
    ao.num_kv_heads = attention_shape[1];
    ao.head_dim = attention_shape[2];
    if (batches_given) ao.batches = batches;
    ao.contexts = contexts;
    ao.prefill_chunk = chunk;
    ao.runs = runs;
    ao.json = json.empty() ? nullptr : std::fopen(json.c_str(), "a");
    const double copy_bps = CopyBandwidth();
    const double gemm_flops = CublasFp16Rate();
    const int rc = exl3::bench::RunAttentionBench(ao, copy_bps, gemm_flops);
    if (ao.json) std::fclose(ao.json);
    return rc;
  }
  if (model.empty() || steps < 1 || chunk < 1 || contexts.empty() || batches.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "a");

  const double copy_bps = CopyBandwidth();
  const double gemm_flops = CublasFp16Rate();
  std::printf("copy bandwidth: %.2f TB/s (device-to-device, read + write); cuBLAS fp16 GEMM 8192^3: %.0f TFLOP/s\n",
              copy_bps * 1e-12, gemm_flops * 1e-12);
  const double t_load = Now();
  CudaModelOptions options;
  options.cuda_graphs = graphs;
  if (max_moe_tokens > 0) options.max_moe_tokens = max_moe_tokens;
  auto opened = CudaModel::Open(model, options);
  if (!opened.ok()) return Fail(opened.status().ToString());
  std::unique_ptr<CudaModel> m = std::move(*opened);
  const auto& cfg = m->config();
  const auto& wb = m->weight_bytes();
  std::printf("model %s: %d layers, hidden %d, %d/%d heads of %d, %d experts top-%d; loaded in %.1f s\n",
              model.c_str(), cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
              cfg.moe.num_experts, cfg.moe.top_k, Now() - t_load);
  std::printf("weights on the GPU: attention %.2f GB, dense MLP %.2f GB, routers %.2f GB, head %.2f GB, experts %.2f GB\n",
              wb.attention * 1e-9, wb.dense_mlp * 1e-9, wb.router * 1e-9, wb.head * 1e-9, wb.experts_resident * 1e-9);

  const int bs = 16, vocab = cfg.vocab_size;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_context = *std::max_element(contexts.begin(), contexts.end());
  const int warmup = 2, private_blocks = (warmup + steps) / bs + 2;
  const int prefix_blocks = max_context / bs + 1;
  if (!m->AllocateKvCache({prefix_blocks + max_batch * private_blocks, bs}).ok()) return Fail("KV cache allocation");

  int moe_layers = 0;
  for (int l = 0; l < cfg.num_layers; ++l) moe_layers += cfg.IsMoeLayer(l) ? 1 : 0;
  const int E = cfg.moe.num_experts, k = cfg.moe.top_k, shared = cfg.moe.has_shared_expert() ? 1 : 0;
  const double per_expert = moe_layers > 0 ? double(wb.experts_resident) / moe_layers / (E + shared) : 0;
  const DecodeCeilings ceilings =
      MeasureDecodeCeilings({&wb.attention_decoded, &wb.dense_mlp_decoded, &wb.head_decoded, &wb.experts_decoded});
  // Decode seconds of the non-expert parts per step, and of one expert (all resident experts'
  // time over their count: the layers' experts share one shape).
  const double decode_attention_s = DecodeSeconds(wb.attention_decoded, ceilings);
  const double decode_dense_s = DecodeSeconds(wb.dense_mlp_decoded, ceilings);
  const double decode_head_s = DecodeSeconds(wb.head_decoded, ceilings);
  const double decode_per_expert_s =
      moe_layers > 0 ? DecodeSeconds(wb.experts_decoded, ceilings) / moe_layers / (E + shared) : 0;
  for (int K = 1; K <= 8; ++K)
    for (int cb = 0; cb < 3; ++cb)
      if (ceilings.weights_per_s[K][cb] > 0)
        std::printf("decode ceiling K=%d codebook %d: %.2f T weights/s\n", K, cb, ceilings.weights_per_s[K][cb] * 1e-12);
  const double kv_bytes_per_position = double(cfg.KvFloatsPerToken()) * 2;  // the fp16 cache

  // FLOPs of a prefill of C tokens: every linear's 2 x params per token (the experts a token is routed
  // to and the shared one; the head for the last token only) plus causal attention's 2 x 2 x heads x
  // head_dim per (query, visible key) pair. Latent attention (MLA, DSA): its projections, kv_b_proj's
  // absorbed products, 2 x heads x (2 latent + rope) per (query, seen key) pair, and DSA's indexer
  // (its projections, 2 x index heads x index_head_dim per (query, visible key) pair) on the layers
  // that run one; a DSA query sees at most index_topk keys.
  const double H = cfg.hidden_size, NHD = double(cfg.num_heads) * cfg.head_dim, KVD = double(cfg.num_kv_heads) * cfg.head_dim;
  const bool latent = cfg.IsLatentAttention();
  const double NH = cfg.num_heads, R = cfg.kv_lora_rank, rope = cfg.qk_rope_head_dim, nope = cfg.qk_nope_head_dim,
               vd = cfg.v_head_dim, qd = nope + rope, NI = cfg.indexer.num_heads, DI = cfg.indexer.head_dim;
  int indexer_layers = 0;
  for (int l = 0; l < cfg.num_layers; ++l) indexer_layers += cfg.HasOwnIndexer(l) ? 1 : 0;
  const double topk = cfg.attention == exl3::engine::AttentionKind::kDsa ? cfg.indexer.topk : 1e30;
  const double q_params = cfg.q_lora_rank > 0 ? H * cfg.q_lora_rank + cfg.q_lora_rank * NH * qd : H * NH * qd;
  const double attn_params = latent ? q_params + H * (R + rope) + NH * vd * H + NH * (nope + vd) * R
                                    : 2 * H * NHD + 2 * H * KVD;
  const double indexer_params = cfg.q_lora_rank * NI * DI + H * DI + H * NI;
  const double expert_params = 3 * H * cfg.moe.moe_intermediate_size;
  const double dense_params = 3 * H * cfg.intermediate_size;
  // Σ over the C queries of min(position + 1, cap): the keys each sees.
  auto seen_pairs = [](double C, double cap) {
    const double dense = std::min(C, cap);
    return dense * (dense + 1) / 2 + (C - dense) * cap;
  };
  auto prefill_flops = [&](double C) {
    double per_token = cfg.num_layers * attn_params + (cfg.num_layers - moe_layers) * dense_params +
                       moe_layers * ((k + shared) * expert_params + E * H) + indexer_layers * indexer_params;
    const double attention = latent ? cfg.num_layers * 2 * NH * (2 * R + rope) * seen_pairs(C, topk) +
                                          indexer_layers * 2 * NI * DI * C * (C + 1) / 2
                                    : cfg.num_layers * 4 * NHD * C * (C + 1) / 2;
    return 2 * C * per_token + 2 * H * cfg.vocab_size + attention;
  };
  // Cache bytes one decode token reads at a context of `positions`: every position's slot (GQA,
  // MLA), or on DSA the latent and rope key of at most index_topk positions plus every position's
  // indexer key on the layers that run an indexer.
  auto kv_bytes_per_token = [&](double positions) {
    if (cfg.attention != exl3::engine::AttentionKind::kDsa) return positions * kv_bytes_per_position;
    return cfg.num_layers * std::min(positions, topk) * (R + rope) * 2 + indexer_layers * positions * DI * 2;
  };
  std::mt19937 rng(5);
  std::vector<float> logits;
  logits.resize(static_cast<size_t>(vocab));
  for (int context : contexts) {
    context = context / bs * bs;  // decode sequences share whole blocks of the prompt
    std::vector<int32_t> prefix_table(prefix_blocks);
    for (int b = 0; b < prefix_blocks; ++b) prefix_table[b] = b;
    // Prefill: the prompt in chunks; time to first token includes the head and the copy of its
    // logits. Timed on the second of two runs: the first prefill of a length pays one-time set-up
    // (workspaces and activations grown), which is not time to first token.
    auto prefill = [&]() -> absl::StatusOr<double> {
      double seconds = 0;
      for (int start = 0; start < context; start += chunk) {
        SequenceChunk c;
        c.sequence_id = 0;
        const int n = std::min(chunk, context - start);
        for (int i = 0; i < n; ++i) c.tokens.push_back(static_cast<int32_t>(rng() % vocab));
        c.start_position = start;
        c.block_table = prefix_table;
        c.wants_logits = start + n == context;
        StepBatch batch;
        batch.chunks.push_back(std::move(c));
        const double t0 = Now();
        EXL3_RETURN_IF_ERROR(m->Forward(batch, logits.data()));
        seconds += Now() - t0;
      }
      return seconds;
    };
    absl::StatusOr<double> ttft_or = prefill();
    if (ttft_or.ok()) ttft_or = prefill();
    if (!ttft_or.ok()) return Fail("prefill: " + ttft_or.status().ToString());
    const double ttft = *ttft_or;
    const exl3::engine::StepPhaseTimes pp = m->LastPhaseTimes();
    std::printf("prefill %5d tokens: time to first token %.1f ms, %.0f tokens/s (last chunk: attention %.1f ms, "
                "MoE %.1f ms, dense MLP %.1f ms, head %.1f ms)\n", context, ttft * 1e3, context / ttft,
                pp.attention_s * 1e3, pp.moe_s * 1e3, pp.dense_mlp_s * 1e3, pp.head_s * 1e3);
    const double prefill_floor = prefill_flops(context) / gemm_flops;
    std::printf("    floor (FLOPs at the cuBLAS fp16 rate) %.1f ms -> %.2fx floor\n", prefill_floor * 1e3,
                ttft / prefill_floor);
    if (jf) std::fprintf(jf, "{\"bench\":\"engine_prefill\",\"context\":%d,\"ttft_s\":%.6f,\"tokens_per_s\":%.1f,"
                         "\"floor_s\":%.6f}\n", context, ttft, context / ttft, prefill_floor);

    for (int B : batches) {
      std::vector<double> times;
      for (int s = 0; s < warmup + steps; ++s) {
        StepBatch batch;
        for (int b = 0; b < B; ++b) {
          SequenceChunk c;
          c.sequence_id = b + 1;
          c.tokens = {static_cast<int32_t>(rng() % vocab)};
          c.start_position = context + s;
          c.block_table.assign(prefix_table.begin(), prefix_table.begin() + context / bs);
          for (int p = 0; p < private_blocks; ++p) c.block_table.push_back(prefix_blocks + b * private_blocks + p);
          c.wants_logits = true;
          batch.chunks.push_back(std::move(c));
        }
        logits.resize(static_cast<size_t>(B) * vocab);
        const double t0 = Now();
        const absl::Status st = m->Forward(batch, logits.data());
        if (s >= warmup) times.push_back(Now() - t0);
        if (!st.ok()) return Fail("decode: " + st.ToString());
      }
      const double step = Median(times);
      const double touched = E > 0 ? E * (1.0 - std::pow(1.0 - double(k) / E, B)) + shared : 0;
      const double kv_bytes = B * kv_bytes_per_token(context + warmup + steps / 2.0);
      const double expert_bytes = moe_layers * touched * per_expert;
      const double bytes = wb.attention + wb.dense_mlp + wb.router + wb.head + B * double(wb.embedding_row) +
                           expert_bytes + kv_bytes;
      // Each part at the slower of reading its bytes and decoding its EXL3 weights.
      const double floor_s = std::max(wb.attention / copy_bps, decode_attention_s) +
                             std::max(wb.dense_mlp / copy_bps, decode_dense_s) +
                             std::max(wb.head / copy_bps, decode_head_s) +
                             std::max(expert_bytes / copy_bps, moe_layers * touched * decode_per_expert_s) +
                             (wb.router + B * double(wb.embedding_row) + kv_bytes) / copy_bps;
      std::printf("decode%s context %5d batch %3d: %.3f ms/step, %.0f tokens/s; floor %.3f ms (%.2f GB/step) -> %.2fx floor\n",
                  graphs ? "" : " (eager)", context, B, step * 1e3, B / step, floor_s * 1e3, bytes * 1e-9,
                  step / floor_s);
      const exl3::engine::StepPhaseTimes ph = m->LastPhaseTimes();
      std::printf("    GPU time of the last step: attention %.3f ms, MoE %.3f ms, dense MLP %.3f ms, head %.3f ms, "
                  "embed %.3f ms\n", ph.attention_s * 1e3, ph.moe_s * 1e3, ph.dense_mlp_s * 1e3, ph.head_s * 1e3,
                  ph.embed_s * 1e3);
      if (jf)
        std::fprintf(jf,
                     "{\"bench\":\"engine_decode\",\"graphs\":%s,\"context\":%d,\"batch\":%d,\"step_s\":%.6f,\"tokens_per_s\":%.1f,"
                     "\"floor_s\":%.6f,\"bytes_per_step\":%.0f}\n",
                     graphs ? "true" : "false", context, B, step, B / step, floor_s, bytes);
    }
  }
  if (jf) std::fclose(jf);
  return 0;
}
