// exl3-engine-bench: what users compare of the GPU engine (engine/cuda/cuda_model.h) on one model,
// with no scheduler or gRPC in the way: time to first token and prefill tokens/s of one prompt,
// then decode tokens/s at several batch sizes with every sequence continuing that prompt (its
// blocks shared, as prefix caching shares them), each beside its floor measured in the same run:
// per part of the step (attention, dense MLPs, head, the experts B tokens touch under uniform
// routing) the slower of reading its bytes at the device's copy bandwidth and decoding its EXL3
// weights at the measured decode ceiling, plus the routers, embeddings and fp16 KV cache read.
//
//   exl3-engine-bench --model DIR [--context 1024,8192] [--batch 1,8,32,64] [--steps 16]
//                     [--prefill-chunk 2048] [--no-graphs] [--verify-graphs] [--max-moe-tokens N] [--json FILE]
//                     [--expert-map FILE [--micro-batches 1,2] [--shared-expert ...]]
//   exl3-engine-bench --attention-only [--attention-shape 96,8,128] [--context 1024,8192]
//                     [--batch 1,8,64] [--prefill-chunk 2048] [--runs 30] [--json FILE]
//   exl3-engine-bench --sampling-only [--vocab 151552] [--batch 1,8,64] [--runs 30] [--json FILE]
//   exl3-engine-bench --model DIR --speculative-acceptance 0,0.5,0.7,0.9,1 [--num-speculative-tokens 1,2,3,4]
//                     [--speculative-draft-length fixed|adaptive|goodput] [--context 1024] [--batch 1,8,32] [--steps 64]
//                     [--expert-map FILE ...] [--json FILE]
//   exl3-engine-bench --model DIR --constrained-tokenizer FILE [--context 1024] [--batch 1,64] [--steps 32]
//                     [--expert-map FILE ...] [--json FILE]
//
// --expert-map: the routed experts on exl3-worker processes, through the router core in this
// process (services/router/in_process_router.h, as exl3-router runs it), the same tables for each
// micro-batch count, against the same floor (the experts' bytes then counted from the model's
// files), and the exchange's time per MoE layer. --attention-only times the attention kernels alone
// (tools/exl3_bench/attention_bench.h); --sampling-only the sampling of a step's rows on the device
// and the old host path (tools/exl3_bench/sampling_bench.h); --speculative-acceptance speculative
// decoding through the Engine with a drafter of a chosen acceptance rate
// (tools/exl3_bench/speculative_bench.h); --constrained-tokenizer the engine's decode step with
// every sequence unconstrained and then constrained by a JSON schema
// (tools/exl3_bench/constraint_step_bench.h). The command line: tools/exl3_bench/engine_bench_options.h.
// GPU only: the CPU engine runs the speculative and constrained benchmarks' libraries in tests
// (and exl3-speculative-cpu-bench).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/command_line.h"
#include "base/status_macros.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/config/read_model_config.h"
#include "engine/cuda/cuda_model.h"
#include "kernels/cuda/bench_hooks.h"
#include "model/exl3_model.h"
#include "services/router/in_process_router.h"
#include "services/router/router_moe_executor.h"
#include "tools/exl3_bench/attention_bench.h"
#include "tools/exl3_bench/constraint_step_bench.h"
#include "tools/exl3_bench/sampling_bench.h"
#include "tools/exl3_bench/engine_bench_options.h"
#include "tools/exl3_bench/speculative_bench.h"

namespace {

using exl3::engine::KvCacheShape;
using exl3::engine::SequenceChunk;
using exl3::engine::StepBatch;
using exl3::engine::cuda::CudaModel;
using exl3::engine::cuda::CudaModelOptions;
using exl3::engine::cuda::DecodedWeights;

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

// Where the experts are in one run of the tables.
struct ExpertPlacement {
  bool remote = false;
  int micro_batches = 1;
  std::string title;  // "in process on this GPU" or "remote, 2 micro-batches"
  std::string label;  // appended to the table's lines: "" or " (remote, 2 micro-batches)"
};

// The experts' weights as the model's files hold them (remote experts: none on this GPU), for the
// floor: every MoE layer's routed and shared experts' bytes and decoded weights.
struct FileExpertWeights {
  int64_t bytes = 0;
  DecodedWeights decoded;
};
absl::StatusOr<FileExpertWeights> ReadFileExpertWeights(const std::string& dir) {
  exl3::Exl3ModelOptions opt;
  opt.require_exl3 = false;
  opt.load_routers = false;
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<exl3::Exl3Model> model, exl3::Exl3Model::Open(dir, opt));
  FileExpertWeights w;
  for (int layer : model->config().MoeLayers()) {
    w.bytes += static_cast<int64_t>(model->LayerBytes(layer));
    EXL3_ASSIGN_OR_RETURN(exl3::MoeLayerView view, model->LayerView(layer));
    for (const exl3::ExpertMlp* e : view.experts)
      if (e != nullptr) for (const exl3::Exl3LinearView* v : {&e->gate, &e->up, &e->down}) w.decoded.Add(*v);
    if (view.shared != nullptr)
      for (const exl3::Exl3LinearView* v : {&view.shared->gate, &view.shared->up, &view.shared->down}) w.decoded.Add(*v);
  }
  return w;
}

struct DeviceRates {
  double copy_bps = 0, gemm_flops = 0;
};

// The tables (time to first token, decode tokens/s) of one opened model. Returns the exit code.
int RunTables(CudaModel& model, const exl3::bench::EngineBenchOptions& o, const ExpertPlacement& placement,
              const FileExpertWeights* file_experts, const DeviceRates& rates, FILE* jf) {
  CudaModel* m = &model;
  const double copy_bps = rates.copy_bps, gemm_flops = rates.gemm_flops;
  const auto& cfg = m->config();
  const auto& wb = m->weight_bytes();
  std::printf("weights on the GPU: attention %.2f GB, dense MLP %.2f GB, routers %.2f GB, head %.2f GB, experts %.2f GB\n",
              wb.attention * 1e-9, wb.dense_mlp * 1e-9, wb.router * 1e-9, wb.head * 1e-9, wb.experts_resident * 1e-9);

  const int bs = 16, vocab = cfg.vocab_size;
  const std::vector<int>& batches = o.batches;
  const std::vector<int>& contexts = o.contexts;
  const int steps = o.steps, chunk = o.prefill_chunk;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_context = *std::max_element(contexts.begin(), contexts.end());
  const int warmup = 2, private_blocks = (warmup + steps) / bs + 2;
  const int prefix_blocks = max_context / bs + 1;
  // Recurrent layers (Qwen3-Next, GLM-5.3-Flash) keep a state per sequence: slot 0 for the prefill's
  // sequence, one for each decode sequence, which prefills its own prompt before the batch's steps
  // (a state, unlike KV blocks, cannot be shared).
  const bool recurrent = cfg.HasRecurrentLayers();
  const absl::Status allocated =
      m->AllocateKvCache({prefix_blocks + max_batch * private_blocks, bs, recurrent ? max_batch + 1 : 0});
  if (!allocated.ok()) return Fail("KV cache allocation: " + allocated.ToString());

  int moe_layers = 0;
  for (int l = 0; l < cfg.num_layers; ++l) moe_layers += cfg.IsMoeLayer(l) ? 1 : 0;
  const int E = cfg.moe.num_experts, k = cfg.moe.top_k, shared = cfg.moe.has_shared_expert() ? 1 : 0;
  // The experts of the floor: those on this GPU, or with remote experts the files' (the same
  // weights; the device copy only adds alignment).
  const int64_t expert_bytes_total = file_experts != nullptr ? file_experts->bytes : wb.experts_resident;
  const DecodedWeights& experts_decoded = file_experts != nullptr ? file_experts->decoded : wb.experts_decoded;
  const double per_expert = moe_layers > 0 ? double(expert_bytes_total) / moe_layers / (E + shared) : 0;
  const DecodeCeilings ceilings =
      MeasureDecodeCeilings({&wb.attention_decoded, &wb.dense_mlp_decoded, &wb.head_decoded, &experts_decoded});
  // Decode seconds of the non-expert parts per step, and of one expert (all experts' time over
  // their count: the layers' experts share one shape).
  const double decode_attention_s = DecodeSeconds(wb.attention_decoded, ceilings);
  const double decode_dense_s = DecodeSeconds(wb.dense_mlp_decoded, ceilings);
  const double decode_head_s = DecodeSeconds(wb.head_decoded, ceilings);
  const double decode_per_expert_s =
      moe_layers > 0 ? DecodeSeconds(experts_decoded, ceilings) / moe_layers / (E + shared) : 0;
  for (int K = 1; K <= 8; ++K)
    for (int cb = 0; cb < 3; ++cb)
      if (ceilings.weights_per_s[K][cb] > 0)
        std::printf("decode ceiling K=%d codebook %d: %.2f T weights/s\n", K, cb, ceilings.weights_per_s[K][cb] * 1e-12);
  const double kv_bytes_per_position = double(cfg.KvFloatsPerToken()) * 2;  // the fp16 cache
  // The routers' fp32 weights: on this GPU, or with remote experts where the router core gates
  // (the same bytes, counted the same, so both placements share one floor).
  const double router_bytes =
      file_experts != nullptr ? double(moe_layers) * E * cfg.hidden_size * sizeof(float) : double(wb.router);

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
  // The exchange of the last step, per MoE layer (both micro-batches' together).
  auto print_exchange = [&](const char* what) {
    const exl3::engine::cuda::RemoteExchangeTimes& ex = m->LastExchangeTimes();
    if (!placement.remote || ex.exchanges == 0 || moe_layers == 0) return;
    const double per = 1e6 / moe_layers;
    std::printf("    exchange per MoE layer (%s, %d exchange(s) a layer): to host %.1f us + call %.1f us + to device "
                "%.1f us = %.1f us; the host blocked in calls %.1f us\n", what, ex.exchanges / moe_layers,
                ex.to_host_s * per, ex.call_s * per, ex.to_device_s * per,
                (ex.to_host_s + ex.call_s + ex.to_device_s) * per, ex.wait_s * per);
  };
  auto exchange_json = [&]() {
    const exl3::engine::cuda::RemoteExchangeTimes& ex = m->LastExchangeTimes();
    if (!placement.remote || moe_layers == 0) return std::string();
    char buf[256];
    std::snprintf(buf, sizeof buf, ",\"exchange_per_layer_s\":{\"to_host\":%.7f,\"call\":%.7f,\"to_device\":%.7f,\"blocked\":%.7f}",
                  ex.to_host_s / moe_layers, ex.call_s / moe_layers, ex.to_device_s / moe_layers, ex.wait_s / moe_layers);
    return std::string(buf);
  };
  const std::string json_placement = "\"experts\":\"" + std::string(placement.remote ? "remote" : "in-process") +
                                     "\",\"micro_batches\":" + std::to_string(placement.micro_batches);
  std::mt19937 rng(5);
  // Random prompt and decode ids, never a multimodal checkpoint's image / video placeholders
  // (inside its vocabulary; the engine refuses them in prompts: ModelInfo::media_placeholders).
  // Redrawn, so the other families' ids are the same draws as before.
  auto random_token = [&]() {
    for (;;) {
      const int32_t t = static_cast<int32_t>(rng() % vocab);
      if (std::none_of(cfg.media_placeholders.begin(), cfg.media_placeholders.end(),
                       [t](const exl3::engine::MediaPlaceholder& m) { return m.token_id == t; }))
        return t;
    }
  };
  std::vector<float> logits;
  logits.resize(static_cast<size_t>(vocab));
  for (int context : contexts) {
    context = context / bs * bs;  // decode sequences share whole blocks of the prompt
    std::vector<int32_t> prefix_table(prefix_blocks);
    for (int b = 0; b < prefix_blocks; ++b) prefix_table[b] = b;
    // Prefill: the prompt in chunks; time to first token includes the head and the copy of its
    // logits. Timed on the second of two runs: the first prefill of a length pays one-time set-up
    // (workspaces and activations grown), which is not time to first token.
    auto prefill = [&](int64_t sequence_id = 0, int slot = 0) -> absl::StatusOr<double> {
      double seconds = 0;
      for (int start = 0; start < context; start += chunk) {
        SequenceChunk c;
        c.sequence_id = sequence_id;
        c.state_slot = slot;
        const int n = std::min(chunk, context - start);
        for (int i = 0; i < n; ++i) c.tokens.push_back(random_token());
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
    std::printf("prefill%s %5d tokens: time to first token %.1f ms, %.0f tokens/s (last chunk: attention %.1f ms, "
                "MoE %.1f ms, dense MLP %.1f ms, head %.1f ms)\n", placement.label.c_str(), context, ttft * 1e3,
                context / ttft, pp.attention_s * 1e3, pp.moe_s * 1e3, pp.dense_mlp_s * 1e3, pp.head_s * 1e3);
    print_exchange("last chunk");
    // The FLOP count above knows GQA, MLA and DSA attention; not KDA and the k-pooled indexer.
    const bool flops_modelled = cfg.attention != exl3::engine::AttentionKind::kPooledDsa;
    const double prefill_floor = flops_modelled ? prefill_flops(context) / gemm_flops : 0;
    if (flops_modelled) {
      std::printf("    floor (FLOPs at the cuBLAS fp16 rate) %.1f ms -> %.2fx floor\n", prefill_floor * 1e3,
                  ttft / prefill_floor);
    } else {
      std::printf("    floor: not modelled for %s's attention (KDA, k-pooled indexer)\n", cfg.architecture().c_str());
    }
    if (jf) std::fprintf(jf, "{\"bench\":\"engine_prefill\",%s,\"context\":%d,\"ttft_s\":%.6f,\"tokens_per_s\":%.1f,"
                         "\"floor_s\":%.6f%s}\n", json_placement.c_str(), context, ttft, context / ttft, prefill_floor,
                         exchange_json().c_str());

    for (int B : batches) {
      std::vector<double> times;
      logits.resize(static_cast<size_t>(B) * vocab);
      if (recurrent) {
        for (int b = 0; b < B; ++b) {
          const absl::StatusOr<double> done = prefill(b + 1, b + 1);
          if (!done.ok()) return Fail("decode sequence's prefill: " + done.status().ToString());
        }
      }
      for (int s = 0; s < warmup + steps; ++s) {
        StepBatch batch;
        for (int b = 0; b < B; ++b) {
          SequenceChunk c;
          c.sequence_id = b + 1;
          c.tokens = {random_token()};
          c.start_position = context + s;
          c.state_slot = recurrent ? b + 1 : 0;
          c.block_table.assign(prefix_table.begin(), prefix_table.begin() + context / bs);
          for (int p = 0; p < private_blocks; ++p) c.block_table.push_back(prefix_blocks + b * private_blocks + p);
          c.wants_logits = true;
          batch.chunks.push_back(std::move(c));
        }
        const double t0 = Now();
        const absl::Status st = m->Forward(batch, logits.data());
        if (s >= warmup) times.push_back(Now() - t0);
        if (!st.ok()) return Fail("decode: " + st.ToString());
      }
      const double step = Median(times);
      const double touched = E > 0 ? E * (1.0 - std::pow(1.0 - double(k) / E, B)) + shared : 0;
      const double kv_bytes = B * kv_bytes_per_token(context + warmup + steps / 2.0);
      const double expert_bytes = moe_layers * touched * per_expert;
      // Recurrent layers read and write each sequence's state every step.
      const double state_bytes = 2.0 * B * cfg.StateFloatsPerSequence() * sizeof(float);
      const double bytes = wb.attention + wb.dense_mlp + router_bytes + wb.head + B * double(wb.embedding_row) +
                           expert_bytes + kv_bytes + state_bytes;
      // Each part at the slower of reading its bytes and decoding its EXL3 weights.
      const double floor_s = std::max(wb.attention / copy_bps, decode_attention_s) +
                             std::max(wb.dense_mlp / copy_bps, decode_dense_s) +
                             std::max(wb.head / copy_bps, decode_head_s) +
                             std::max(expert_bytes / copy_bps, moe_layers * touched * decode_per_expert_s) +
                             (router_bytes + B * double(wb.embedding_row) + kv_bytes + state_bytes) / copy_bps;
      const bool eager = !o.graphs || placement.remote;
      std::printf("decode%s%s context %5d batch %3d: %.3f ms/step, %.0f tokens/s; floor %.3f ms (%.2f GB/step) -> %.2fx floor\n",
                  placement.label.c_str(), eager && !placement.remote ? " (eager)" : "", context, B, step * 1e3,
                  B / step, floor_s * 1e3, bytes * 1e-9, step / floor_s);
      const exl3::engine::StepPhaseTimes ph = m->LastPhaseTimes();
      // A graph replay has no marks of its own: its time is split as the eager step before its
      // capture spent it (engine/cuda/decode_graphs.h), whose many small launches can leave the GPU
      // waiting on the host, so the split overstates the phases of many small kernels (attention).
      // scripts/gpu/profile_step.sh times each kernel instead.
      std::printf("    %s: attention %.3f ms, MoE %.3f ms, dense MLP %.3f ms, head %.3f ms, embed %.3f ms\n",
                  eager ? "GPU time of the last step"
                        : "the last step's time split as its graph's eager run spent it (not measured per phase)",
                  ph.attention_s * 1e3, ph.moe_s * 1e3, ph.dense_mlp_s * 1e3, ph.head_s * 1e3, ph.embed_s * 1e3);
      print_exchange("last step");
      if (jf)
        std::fprintf(jf,
                     "{\"bench\":\"engine_decode\",%s,\"graphs\":%s,\"context\":%d,\"batch\":%d,\"step_s\":%.6f,"
                     "\"tokens_per_s\":%.1f,\"floor_s\":%.6f,\"bytes_per_step\":%.0f%s}\n",
                     json_placement.c_str(), eager ? "false" : "true", context, B, step, B / step, floor_s, bytes,
                     exchange_json().c_str());
    }
  }
  return 0;
}

// The GPU model with the command line's options, its experts where `placement` says (through
// `router`'s workers when it is set).
absl::StatusOr<std::unique_ptr<CudaModel>> OpenBenchModel(const exl3::bench::EngineBenchOptions& o,
                                                          const ExpertPlacement& placement,
                                                          exl3::router::InProcessRouter* router,
                                                          const exl3::router::InProcessRouterOptions& ro,
                                                          int hidden_size) {
  CudaModelOptions options;
  options.cuda_graphs = o.graphs;
  options.verify_graphs = o.verify_graphs;
  if (o.max_moe_tokens > 0) options.max_moe_tokens = o.max_moe_tokens;
  options.micro_batches = placement.micro_batches;
  std::unique_ptr<exl3::engine::MoeExecutor> executor;
  if (router != nullptr)
    executor = std::make_unique<exl3::router::RouterMoeExecutor>(router->core().service(),
                                                                 ro.core.router.inline_max_tokens, hidden_size,
                                                                 std::chrono::milliseconds(o.moe_timeout_ms));
  return CudaModel::Open(o.model, options, std::move(executor));
}

// The GPU model as the Engine's runner (the benchmarks through the Engine); null after printing
// why it did not open.
std::unique_ptr<exl3::engine::ModelRunner> OpenEngineRunner(const exl3::bench::EngineBenchOptions& o,
                                                            const ExpertPlacement& placement,
                                                            exl3::router::InProcessRouter* router,
                                                            const exl3::router::InProcessRouterOptions& ro,
                                                            int hidden_size) {
  auto opened = OpenBenchModel(o, placement, router, ro, hidden_size);
  if (!opened.ok()) {
    std::fprintf(stderr, "exl3-engine-bench: %s\n", opened.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*opened);
}

// --speculative-acceptance: speculative decoding through the Engine with the recorded drafter
// (tools/exl3_bench/speculative_bench.h), the model opened anew for each --context. Returns the
// exit code.
int RunSpeculative(const exl3::bench::EngineBenchOptions& o, const ExpertPlacement& placement,
                   exl3::router::InProcessRouter* router, const exl3::router::InProcessRouterOptions& ro,
                   int hidden_size, FILE* jf) {
  namespace bench = exl3::bench;
  namespace engine = exl3::engine;
  const int max_k = *std::max_element(o.speculative_ks.begin(), o.speculative_ks.end());
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  for (const int context : o.contexts) {
    bench::SpeculativeBenchOptions so;
    so.batches = o.batches;
    so.acceptances = o.speculative_acceptances;
    so.ks = o.speculative_ks;
    so.prompt_tokens = context;
    so.decode_tokens = o.steps;
    // ParseEngineBenchArgs took only the names ParseDraftLengthPolicy knows.
    so.draft_length = *engine::ParseDraftLengthPolicy(o.speculative_draft_length);
    so.engine.block_size = 16;
    so.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens,
                             int64_t{max_batch} * (context + o.steps + max_k + 32)};
    so.engine.scheduler.max_num_batched_tokens = std::max(o.prefill_chunk, max_batch * (1 + max_k));
    so.engine.scheduler.max_num_seqs = max_batch;
    so.engine.sampling_threads = engine::DefaultSamplingThreads();  // as exl3-router samples
    auto open = [&] { return OpenEngineRunner(o, placement, router, ro, hidden_size); };
    std::printf("=== speculative decoding, experts %s: prompts of %d tokens, %d greedy tokens each, draft length %s\n",
                placement.title.c_str(), context, o.steps, o.speculative_draft_length.c_str());
    const double t0 = Now();
    absl::StatusOr<std::vector<bench::SpeculativeBenchRow>> rows = bench::RunSpeculativeBench(so, open);
    if (!rows.ok()) return Fail("speculative bench: " + rows.status().ToString());
    bench::PrintSpeculativeBench(*rows, stdout, jf);
    std::printf("(%.1f s)\n", Now() - t0);
  }
  return 0;
}

// --constrained-tokenizer: decode steps through the Engine unconstrained and constrained
// (tools/exl3_bench/constraint_step_bench.h), the model opened anew for each --context. Returns the
// exit code.
int RunConstraintSteps(const exl3::bench::EngineBenchOptions& o, const std::string& tokenizer_json,
                       const ExpertPlacement& placement, exl3::router::InProcessRouter* router,
                       const exl3::router::InProcessRouterOptions& ro, int hidden_size, FILE* jf) {
  namespace bench = exl3::bench;
  namespace engine = exl3::engine;
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  for (const int context : o.contexts) {
    bench::ConstraintStepBenchOptions co;
    co.batches = o.batches;
    co.prompt_tokens = context;
    co.steps = o.steps;
    co.tokenizer_json = tokenizer_json;
    co.engine.block_size = 16;
    co.engine.scheduler.max_num_batched_tokens = std::max(o.prefill_chunk, max_batch);
    co.engine.scheduler.max_num_seqs = max_batch;
    co.engine.sampling_threads = engine::DefaultSamplingThreads();  // as exl3-router samples
    const int max_tokens =
        bench::ConstraintStepMaxTokens(max_batch, context, o.steps, co.engine.scheduler.max_num_batched_tokens);
    co.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens, int64_t{max_batch} * (context + max_tokens + 32)};
    std::printf("=== constrained decoding's step, experts %s: prompts of %d tokens, about %d full-batch steps per run, "
                "tokenizer %s\n",
                placement.title.c_str(), context, o.steps, o.constrained_tokenizer.c_str());
    const double t0 = Now();
    absl::StatusOr<bench::ConstraintStepBenchResult> result = bench::RunConstraintStepBench(
        co, [&] { return OpenEngineRunner(o, placement, router, ro, hidden_size); });
    if (!result.ok()) return Fail("constraint step bench: " + result.status().ToString());
    bench::PrintConstraintStepBench(*result, stdout, jf, placement.remote ? placement.title : "local");
    std::printf("(%.1f s)\n", Now() - t0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-engine-bench")) return 0;
  namespace bench = exl3::bench;
  absl::StatusOr<bench::EngineBenchOptions> parsed =
      bench::ParseEngineBenchArgs(std::vector<std::string>(argv + 1, argv + argc));
  if (!parsed.ok()) {
    std::fprintf(stderr, "exl3-engine-bench: %s\n%s", std::string(parsed.status().message()).c_str(),
                 bench::kEngineBenchUsage);
    return 2;
  }
  const bench::EngineBenchOptions& o = *parsed;
  if (o.help) {
    std::fputs(bench::kEngineBenchUsage, stdout);
    return 0;
  }
  if (o.sampling_only) {
    bench::SamplingBenchOptions so;
    so.vocab = o.sampling_vocab;
    if (o.batches_given) so.batches = o.batches;
    so.runs = o.runs;
    so.json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "a");
    const int rc = bench::RunSamplingBench(so);
    if (so.json) std::fclose(so.json);
    return rc;
  }
  if (o.attention_only) {
    bench::AttentionBenchOptions ao;
    ao.num_heads = o.attention_shape[0];
    ao.num_kv_heads = o.attention_shape[1];
    ao.head_dim = o.attention_shape[2];
    if (o.batches_given) ao.batches = o.batches;
    ao.contexts = o.contexts;
    ao.prefill_chunk = o.prefill_chunk;
    ao.runs = o.runs;
    ao.json = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "a");
    const double copy_bps = CopyBandwidth();
    const double gemm_flops = CublasFp16Rate();
    const int rc = bench::RunAttentionBench(ao, copy_bps, gemm_flops);
    if (ao.json) std::fclose(ao.json);
    return rc;
  }
  // A bad map is a usage error, found before any GPU work.
  if (const absl::Status st = bench::CheckBenchExpertMap(o); !st.ok()) {
    std::fprintf(stderr, "exl3-engine-bench: %s\n", std::string(st.message()).c_str());
    return 2;
  }
  auto cfg_or = exl3::engine::LoadModelConfig(o.model);
  if (!cfg_or.ok()) return Fail(cfg_or.status().ToString());
  // --constrained-tokenizer: a file the grammar compiler refuses for this model is a usage error,
  // found before any GPU work.
  std::string tokenizer_json;
  if (o.constrained()) {
    std::ifstream in(o.constrained_tokenizer, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    tokenizer_json = text.str();
    const absl::Status st =
        !in ? absl::NotFoundError(absl::StrCat("--constrained-tokenizer: cannot read ", o.constrained_tokenizer))
            : bench::CheckConstraintTokenizer(o.constrained_tokenizer, tokenizer_json, cfg_or->vocab_size);
    if (!st.ok()) {
      std::fprintf(stderr, "exl3-engine-bench: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  FILE* jf = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "a");

  DeviceRates rates;
  rates.copy_bps = CopyBandwidth();
  rates.gemm_flops = CublasFp16Rate();
  std::printf("copy bandwidth: %.2f TB/s (device-to-device, read + write); cuBLAS fp16 GEMM 8192^3: %.0f TFLOP/s\n",
              rates.copy_bps * 1e-12, rates.gemm_flops * 1e-12);

  // Remote experts: the router core as exl3-router builds it, its workers ready.
  std::unique_ptr<exl3::router::InProcessRouter> router;
  exl3::router::InProcessRouterOptions ro;
  std::optional<FileExpertWeights> file_experts;
  if (o.remote()) {
    ro.core.model_dir = o.model;
    ro.core.expert_map_path = o.expert_map;
    ro.core.worker_shm_bytes = static_cast<size_t>(o.worker_shm_mb) << 20;
    if (o.shared_expert == "local") {
      ro.core.router.shared_expert_local = true;
    } else if (o.shared_expert == "none") {
      ro.core.router.shared_expert_local = false;
    } else {
      ro.core.router.shared_expert_local = false;
      ro.core.router.shared_expert_worker = o.shared_expert.substr(7);
    }
    ro.ready_timeout = std::chrono::milliseconds(int64_t{o.ready_timeout_s} * 1000);
    const double t0 = Now();
    auto created = exl3::router::InProcessRouter::Create(ro);
    if (!created.ok()) return Fail("router core: " + created.status().ToString());
    router = std::move(*created);
    std::printf("remote experts: %zu worker(s) of %s ready in %.1f s; shared expert %s; shared-memory channel %d MiB%s\n",
                router->core().map().workers.size(), o.expert_map.c_str(), Now() - t0, o.shared_expert.c_str(),
                o.worker_shm_mb, o.worker_shm_mb == 0 ? " (off: gRPC)" : " (same-host workers)");
    auto fe = ReadFileExpertWeights(o.model);
    if (!fe.ok()) return Fail("the experts' weights for the floor: " + fe.status().ToString());
    file_experts = std::move(*fe);
  }

  std::vector<ExpertPlacement> placements;
  if (o.remote()) {
    for (int mb : o.micro_batches) {
      const std::string title = "remote, " + std::to_string(mb) + (mb == 1 ? " micro-batch" : " micro-batches");
      placements.push_back({true, mb, title, " (" + title + ")"});
    }
  } else {
    placements.push_back({false, 1, "in process on this GPU", ""});
  }
  int rc = 0;
  if (o.speculative() || o.constrained()) {
    for (const ExpertPlacement& placement : placements) {
      rc = o.speculative() ? RunSpeculative(o, placement, router.get(), ro, cfg_or->hidden_size, jf)
                           : RunConstraintSteps(o, tokenizer_json, placement, router.get(), ro, cfg_or->hidden_size, jf);
      if (rc != 0) break;
    }
    if (jf) std::fclose(jf);
    return rc;
  }
  for (const ExpertPlacement& placement : placements) {
    const double t_load = Now();
    auto opened = OpenBenchModel(o, placement, router.get(), ro, cfg_or->hidden_size);
    if (!opened.ok()) return Fail(opened.status().ToString());
    std::unique_ptr<CudaModel> m = std::move(*opened);
    const auto& cfg = m->config();
    std::printf("=== experts %s\nmodel %s: %d layers, hidden %d, %d/%d heads of %d, %d experts top-%d; loaded in %.1f s\n",
                placement.title.c_str(),
                o.model.c_str(), cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.moe.num_experts, cfg.moe.top_k, Now() - t_load);
    rc = RunTables(*m, o, placement, file_experts ? &*file_experts : nullptr, rates, jf);
    if (rc != 0) break;
  }
  if (jf) std::fclose(jf);
  return rc;
}
