// exl3-bench: speed of the EXL3 CUDA kernels against their floors, on the GPU machine.
//   exl3-bench ceiling [--json FILE]   copy bandwidth, decode ceiling per codebook, cuBLAS fp16 rate
//   exl3-bench gemv    [--json FILE]   dense GEMV (m = 1..32; both paths) at model shapes, K = 2..4
//   exl3-bench moe     [--json FILE] [--stack N]   fused MoE decode at GLM-5.3-Flash etc. shapes
//   exl3-bench gemm    [--json FILE]   prefill GEMM and expert-grouped MoE prefill vs cuBLAS
// Every figure: median over many timed replays (CUDA events, CUDA graphs of several calls on
// rotating weight copies and inputs so the L2 does not flatter), printed beside its floor =
// max(bytes / copy bandwidth, weights / decode ceiling) and the reference path (dequant + cuBLAS).
// Floors use the ceilings measured in the same process (run `ceiling` first when run alone:
// every subcommand measures what it needs).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "base/command_line.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/bench_hooks.h"
#include "kernels/cuda/gemv_plan.h"
#include "tools/exl3_bench/exit_on_error.h"
#include "tools/exl3_bench/random_exl3.h"

namespace exl3 {
namespace {

using benchutil::ProjSpec;
using benchutil::RandomLinear;
using benchutil::RandomMoeLayer;
using benchutil::RandomVector;

struct Ceilings {
  double copy_bps = 0;          // bytes/s (read + write)
  double decode_wps[3] = {};    // weights/s per codebook (K = 2)
  double cublas_flops = 0;      // fp16 GEMM 8192^3, fp32 accumulate
};

std::vector<std::string> g_json;  // one object per result
cudaStream_t g_stream;

void Json(const std::string& obj) { g_json.push_back(obj); }

// Median of per-call times (seconds): fn(i) enqueues call i on g_stream; `calls` calls are captured
// into one graph (when graph) and replayed `reps` times.
double TimeMedian(const std::function<void(int)>& fn, int calls, int reps, bool graph = true) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  cudaGraphExec_t ge = nullptr;
  if (graph) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; ++i) fn(i);
    CK(cudaStreamEndCapture(g_stream, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
  }
  auto run = [&] {
    if (graph) {
      CK(cudaGraphLaunch(ge, g_stream));
    } else {
      for (int i = 0; i < calls; ++i) fn(i);
    }
  };
  for (int w = 0; w < 3; ++w) run();
  CK(cudaStreamSynchronize(g_stream));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, g_stream));
    run();
    CK(cudaEventRecord(b, g_stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3 / calls);
  }
  if (ge) CK(cudaGraphExecDestroy(ge));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// ---------------------------------------------------------------------------------------------
Ceilings MeasureCeilings(bool print) {
  Ceilings c;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  {
    const size_t bytes = size_t(2) << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&dst, bytes));
    CK(cudaMemset(src, 0x5a, bytes));
    const double t = TimeMedian([&](int) { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_stream)); },
                                1, 20, false);
    c.copy_bps = 2.0 * bytes / t;
    CK(cudaFree(src));
    CK(cudaFree(dst));
  }
  uint32_t* seeds;
  float* out;
  const int grid = sms * 8, block = 256, iters = 2048;
  CK(cudaMalloc(&seeds, 1024 * 4));
  CK(cudaMalloc(&out, size_t(grid) * block * 4));
  std::vector<uint32_t> hs(1024);
  benchutil::Rng rng(5);
  for (auto& s : hs) s = static_cast<uint32_t>(rng.Next());
  CK(cudaMemcpy(seeds, hs.data(), 4096, cudaMemcpyHostToDevice));
  const char* names[3] = {"3inst", "mcg", "mul1"};
  for (int K : {2, 4}) {
    for (int cb = 0; cb < 3; ++cb) {
      const double t = TimeMedian(
          [&](int) { OK(cuda::RunDecodeCeiling(K, cb, seeds, out, iters, grid, block, g_stream)); }, 1, 10,
          false);
      const double weights = double(grid) * (block / 32) * iters * 4 * 256;
      if (K == 2) c.decode_wps[cb] = weights / t;
      if (print) {
        std::printf("decode ceiling K=%d %-5s : %.2f T weights/s (decode + 2 mma per tile, words in registers)\n", K,
                    names[cb], weights / t * 1e-12);
        Json("{\"bench\":\"ceiling\",\"what\":\"decode\",\"K\":" + std::to_string(K) + ",\"codebook\":\"" + names[cb] +
             "\",\"weights_per_s\":" + std::to_string(weights / t) + "}");
      }
    }
  }
  CK(cudaFree(seeds));
  CK(cudaFree(out));
  {
    cublasHandle_t h;
    cublasCreate(&h);
    cublasSetStream(h, g_stream);
    const int n = 8192;
    __half *A, *B;
    float* C;
    CK(cudaMalloc(&A, size_t(n) * n * 2));
    CK(cudaMalloc(&B, size_t(n) * n * 2));
    CK(cudaMalloc(&C, size_t(n) * n * 4));
    std::vector<uint16_t> hv(size_t(n) * n);
    for (auto& v : hv) v = FloatToHalfBits(rng.Normal() * 0.1f);
    CK(cudaMemcpy(A, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
    const float al = 1, be = 0;
    const double t = TimeMedian(
        [&](int) {
          cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &al, A, CUDA_R_16F, n, B, CUDA_R_16F, n, &be, C,
                       CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        },
        1, 10, false);
    c.cublas_flops = 2.0 * n * n * n / t;
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
    cublasDestroy(h);
  }
  if (print) {
    std::printf("copy bandwidth            : %.2f TB/s (device-to-device, read + write)\n", c.copy_bps * 1e-12);
    std::printf("cuBLAS fp16 GEMM 8192^3   : %.1f TFLOP/s (fp16 in, fp32 accumulate and out)\n", c.cublas_flops * 1e-12);
    Json("{\"bench\":\"ceiling\",\"what\":\"copy\",\"bytes_per_s\":" + std::to_string(c.copy_bps) + "}");
    Json("{\"bench\":\"ceiling\",\"what\":\"cublas_fp16\",\"flops\":" + std::to_string(c.cublas_flops) + "}");
  }
  return c;
}

double DecodeWps(const Ceilings& c, Codebook cb) { return c.decode_wps[static_cast<int>(cb)]; }

// ---------------------------------------------------------------------------------------------
void BenchGemv(const Ceilings& c) {
  struct Shape {
    int k, n;
  };
  // 4096x4096 and 5120x5120: shapes where the path rule (PlanDenseGemv, kernels/cuda/gemv_plan.cu)
  // takes either path by m.
  const Shape shapes[] = {{4096, 14336}, {14336, 4096}, {4096, 2048}, {2048, 4096},
                          {5120, 2304},  {4096, 4096},  {5120, 5120}};
  // native: what LinearForward chooses (path: 1 or 3 launches, G the GEMM); 1-launch / 3-launch /
  // gemm: each path forced (bench_hooks.h; above kGemvMaxRows rows every column is the GEMM).
  std::printf("\n%-34s %9s %9s %9s %9s %9s %9s %9s %7s %9s\n", "GEMV (LinearForward)", "native", "1-launch",
              "3-launch", "gemm", "floor", "bytes-fl", "decode-fl", "x floor", "reference");
  {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const double t = TimeMedian([&](int) { OK(cuda::RunEmptyLaunch(3 * sms, g_stream)); }, 64, 30);
    std::printf("launch floor: an empty PDL kernel (%d x 256 threads), 64 per graph: %.2f us per launch\n", 3 * sms,
                t * 1e6);
    Json("{\"bench\":\"launch-floor\",\"grid\":" + std::to_string(3 * sms) + ",\"us\":" + std::to_string(t * 1e6) +
         "}");
  }
  int sm_count = 0;
  CK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  cuda::Workspace ws;
  // EXL3_BENCH_FIRST_ONLY=1: only m=1 4096x14336 K=2 mcg (for profiling one configuration).
  const bool first_only = std::getenv("EXL3_BENCH_FIRST_ONLY") != nullptr;
  for (int m : {1, 2, 4, 8, 16, 32, 48, 64}) {
    for (const Shape& s : shapes) {
      for (int K : {2, 3, 4}) {
        for (Codebook cb : {Codebook::kMcg, Codebook::k3Inst, Codebook::kMul1}) {
          if (cb != Codebook::kMcg && !(K == 2 && s.k == 4096 && s.n == 14336 && (m == 1 || m == 8))) continue;
          if (m != 1 && K != 2) continue;
          if (first_only && (m != 1 || s.n != 14336 || s.k != 4096 || K != 2 || cb != Codebook::kMcg)) continue;
          RandomLinear L(s.k, s.n, K, cb, 100 + K);
          // Rotate enough weight copies to exceed 4x the L2 (60 MB).
          const size_t wbytes = L.view.trellis_words() * 2;
          const int copies = std::clamp<int>(static_cast<int>((256u << 20) / wbytes) + 1, 2, 64);
          std::vector<std::unique_ptr<cuda::DeviceLinear>> devs;
          for (int i = 0; i < copies; ++i) {
            auto d = cuda::DeviceLinear::Upload(L.view);
            OK(d.status());
            devs.push_back(std::move(*d));
          }
          const auto x = RandomVector(size_t(m) * s.k * copies, 7);
          float *dx, *dy;
          CK(cudaMalloc(&dx, x.size() * 4));
          CK(cudaMalloc(&dy, size_t(m) * s.n * 4 * copies));
          CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
          auto call = [&](cuda::Path p) {
            return [&, p](int i) {
              OK(cuda::LinearForward(devs[i % copies]->view(), dx + size_t(i % copies) * m * s.k, m,
                                     dy + size_t(i % copies) * m * s.n, &ws, g_stream, p));
            };
          };
          call(cuda::Path::kNative)(0);  // grow the workspace outside capture
          call(cuda::Path::kReference)(0);
          CK(cudaStreamSynchronize(g_stream));
          const double t = TimeMedian(call(cuda::Path::kNative), copies, 30);
          cuda::SetGemvPathOverride(1);
          call(cuda::Path::kNative)(0);  // grow the one-launch workspace outside capture
          CK(cudaStreamSynchronize(g_stream));
          const double t1 = TimeMedian(call(cuda::Path::kNative), copies, 30);
          cuda::SetGemvPathOverride(2);
          call(cuda::Path::kNative)(0);  // grow the three-launch workspace outside capture
          CK(cudaStreamSynchronize(g_stream));
          const double t3 = TimeMedian(call(cuda::Path::kNative), copies, 30);
          cuda::SetGemvPathOverride(3);
          call(cuda::Path::kNative)(0);
          CK(cudaStreamSynchronize(g_stream));
          const double tg = TimeMedian(call(cuda::Path::kNative), copies, 30);
          cuda::SetGemvPathOverride(0);
          const double tr = TimeMedian(call(cuda::Path::kReference), copies, 10);
          const double bytes = wbytes + (s.k + s.n) * 2.0 + m * (s.k + s.n) * 4.0;
          const double fb = bytes / c.copy_bps, fd = double(s.k) * s.n / DecodeWps(c, cb);
          const double floor = std::max(fb, fd);
          char name[96];
          const int chosen = cuda::GemvPathFor(m, s.k, s.n, K, sm_count);
          const int path = chosen == 1 ? 1 : chosen == 2 ? 3 : 0;  // launches; 0: the GEMM
          std::snprintf(name, sizeof name, "m=%d %5dx%-5d K=%d %-5s (%s)", m, s.k, s.n, K,
                        std::string(CodebookName(cb)).c_str(), path == 1 ? "1L" : path == 3 ? "3L" : "G");
          std::printf("%-34s %7.1fus %7.1fus %7.1fus %7.1fus %7.1fus %7.1fus %7.1fus %6.2fx %7.1fus\n", name,
                      t * 1e6, t1 * 1e6, t3 * 1e6, tg * 1e6, floor * 1e6, fb * 1e6, fd * 1e6, t / floor, tr * 1e6);
          char js[640];
          std::snprintf(js, sizeof js,
                        "{\"bench\":\"gemv\",\"m\":%d,\"k\":%d,\"n\":%d,\"K\":%d,\"codebook\":\"%s\",\"launches\":%d,"
                        "\"native_us\":%.2f,\"one_launch_us\":%.2f,\"three_launch_us\":%.2f,"
                        "\"gemm_us\":%.2f,\"floor_us\":%.2f,\"bytes_floor_us\":%.2f,\"decode_floor_us\":%.2f,\"reference_us\":%.2f}",
                        m, s.k, s.n, K, std::string(CodebookName(cb)).c_str(), path, t * 1e6, t1 * 1e6, t3 * 1e6,
                        tg * 1e6, floor * 1e6, fb * 1e6, fd * 1e6, tr * 1e6);
          Json(js);
          // K = 2 MCG, m = 1 and 8: the one-launch GEMV (forced) at forced k-slice lengths (the cost
          // model's choice is the 1-launch column above), to check the model against the device.
          if (K == 2 && cb == Codebook::kMcg && (m == 1 || m == 8) && !first_only) {
            cuda::SetGemvPathOverride(1);
            std::printf("  k-slice sweep:");
            for (int slice : {2, 3, 4, 6, 8, 10, 12, 14, 16}) {
              cuda::SetDenseGemvSliceOverride(slice);
              const double ts = TimeMedian(call(cuda::Path::kNative), copies, 30);
              std::printf(" %d:%.1fus", slice, ts * 1e6);
              std::snprintf(js, sizeof js,
                            "{\"bench\":\"gemv-slice\",\"m\":%d,\"k\":%d,\"n\":%d,\"K\":%d,\"slice\":%d,"
                            "\"native_us\":%.2f}",
                            m, s.k, s.n, K, slice, ts * 1e6);
              Json(js);
            }
            cuda::SetDenseGemvSliceOverride(0);
            cuda::SetGemvPathOverride(0);
            std::printf("\n");
          }
          CK(cudaFree(dx));
          CK(cudaFree(dy));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
struct MoeShape {
  const char* name;
  int hidden, inter, experts, topk, shared_inter;
};

void BenchMoe(const Ceilings& c, int stack) {
  const MoeShape shapes[] = {
      {"GLM-5.3-Flash", 4096, 2048, 288, 8, 2048},
      {"DeepSeek-V4.1-Flash", 5120, 2304, 384, 6, 2304},
      {"Qwen3.8-Flash-Next", 2560, 640, 512, 10, 0},
  };
  // "chain": the native launch chain (forced); "coop": the one-launch cooperative decode
  // (kernels/cuda/moe_cooperative.cu) where it covers T (MoeRunner::SequenceFor), "-" elsewhere;
  // both timed in the same run, each the median of 30 replays of a graph of 8 calls after warm-up.
  std::printf("\n%-44s %9s %9s %9s %9s %9s %7s %7s %9s\n", "MoE layer (routed + shared, CUDA graph)", "chain", "coop",
              "floor", "bytes-fl", "decode-fl", "chain/fl", "coop/fl", "reference");
  for (const MoeShape& s : shapes) {
    for (int K : {2, 3, 4}) {
      for (Codebook cb : {Codebook::kMcg, Codebook::kMul1}) {
        if (s.experts != 288 && (K != 2 || cb != Codebook::kMcg)) continue;
        if (cb == Codebook::kMul1 && K != 2) continue;
        ProjSpec p{K, cb};
        RandomMoeLayer layer(s.hidden, s.inter, s.experts, 0, p, p, p, s.shared_inter, p, p, p, 10.0f, 11 + K);
        auto dev = cuda::DeviceMoeLayer::Upload(layer.view);
        OK(dev.status());
        for (int T : {1, 8, 16, 64}) {
          auto runner = cuda::MoeRunner::Create(**dev, T, s.topk, cuda::Path::kNative);
          OK(runner.status());
          (*runner)->ForceSequence(cuda::MoeSequence::kChain);
          auto coopr = cuda::MoeRunner::Create(**dev, T, s.topk, cuda::Path::kNative);
          OK(coopr.status());
          (*coopr)->ForceSequence(cuda::MoeSequence::kCooperative);
          const bool coop_covers = (*coopr)->SequenceFor(T) == cuda::MoeSequence::kCooperative;
          auto refr = cuda::MoeRunner::Create(**dev, T, s.topk, cuda::Path::kReference);
          OK(refr.status());
          const int sets = 8;
          std::vector<int32_t> ids(size_t(sets) * T * s.topk);
          std::vector<float> w(ids.size());
          benchutil::Rng rng(T * 31 + K);
          double touched = 0;
          for (int q = 0; q < sets; ++q) {
            std::set<int> distinct;
            for (int t = 0; t < T; ++t) {
              std::vector<int> ch;
              for (int k = 0; k < s.topk; ++k) {
                int e;
                do {
                  e = static_cast<int>(rng.Next() % s.experts);
                } while (std::find(ch.begin(), ch.end(), e) != ch.end());
                ch.push_back(e);
                distinct.insert(e);
                ids[(size_t(q) * T + t) * s.topk + k] = e;
                w[(size_t(q) * T + t) * s.topk + k] = rng.Uniform();
              }
            }
            touched += distinct.size();
          }
          touched /= sets;
          const auto x = RandomVector(size_t(sets) * T * s.hidden, 3);
          float *dx, *dout, *dw;
          int32_t* dids;
          CK(cudaMalloc(&dx, x.size() * 4));
          CK(cudaMalloc(&dout, size_t(sets) * T * s.hidden * 4));
          CK(cudaMalloc(&dids, ids.size() * 4));
          CK(cudaMalloc(&dw, w.size() * 4));
          CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
          auto call = [&](cuda::MoeRunner* r) {
            return [&, r](int i) {
              const int q = i % sets;
              OK(r->Forward(dx + size_t(q) * T * s.hidden, T, dids + size_t(q) * T * s.topk,
                            dw + size_t(q) * T * s.topk, dout + size_t(q) * T * s.hidden, g_stream, true));
            };
          };
          call(runner->get())(0);
          if (coop_covers) call(coopr->get())(0);
          CK(cudaStreamSynchronize(g_stream));
          const double t = TimeMedian(call(runner->get()), sets, 30);
          const double tc = coop_covers ? TimeMedian(call(coopr->get()), sets, 30) : 0.0;
          const double tr = TimeMedian(call(refr->get()), 2, 3, false);
          const double wexp = 3.0 * s.hidden * s.inter;
          const double weights = touched * wexp + (s.shared_inter ? 3.0 * s.hidden * s.shared_inter : 0);
          const double bytes = weights * K / 8 + T * s.hidden * 8.0;
          const double fb = bytes / c.copy_bps, fd = weights / DecodeWps(c, cb);
          const double floor = std::max(fb, fd);
          char name[96];
          std::snprintf(name, sizeof name, "%s K=%d %s T=%d (%.1f experts)", s.name, K,
                        std::string(CodebookName(cb)).c_str(), T, touched);
          char coop_us[16] = "-", coop_x[16] = "-", coop_js[16] = "null";
          if (coop_covers) {
            std::snprintf(coop_us, sizeof coop_us, "%.1fus", tc * 1e6);
            std::snprintf(coop_x, sizeof coop_x, "%.2fx", tc / floor);
            std::snprintf(coop_js, sizeof coop_js, "%.2f", tc * 1e6);
          }
          std::printf("%-44s %7.1fus %9s %7.1fus %7.1fus %7.1fus %6.2fx %7s %7.1fus\n", name, t * 1e6, coop_us,
                      floor * 1e6, fb * 1e6, fd * 1e6, t / floor, coop_x, tr * 1e6);
          char js[640];
          std::snprintf(js, sizeof js,
                        "{\"bench\":\"moe\",\"model\":\"%s\",\"K\":%d,\"codebook\":\"%s\",\"T\":%d,\"experts_touched\":%.2f,"
                        "\"native_us\":%.2f,\"coop_us\":%s,\"floor_us\":%.2f,\"bytes_floor_us\":%.2f,\"decode_floor_us\":%.2f,"
                        "\"reference_us\":%.2f}",
                        s.name, K, std::string(CodebookName(cb)).c_str(), T, touched, t * 1e6, coop_js, floor * 1e6,
                        fb * 1e6, fd * 1e6, tr * 1e6);
          Json(js);
          CK(cudaFree(dx));
          CK(cudaFree(dout));
          CK(cudaFree(dids));
          CK(cudaFree(dw));
        }
        // The layer stack: `stack` copies of this layer resident, one token step through all.
        if (stack > 0 && s.experts == 288 && K == 2 && cb == Codebook::kMcg) {
          std::vector<std::unique_ptr<cuda::DeviceMoeLayer>> layers;
          for (int l = 0; l < stack; ++l) {
            auto d = cuda::DeviceMoeLayer::Upload(layer.view);
            if (!d.ok()) {
              std::printf("stack: stopped at layer %d: %s\n", l, d.status().ToString().c_str());
              break;
            }
            layers.push_back(std::move(*d));
          }
          for (int T : {1, 8, 32}) {
            std::vector<std::unique_ptr<cuda::MoeRunner>> runners;
            for (auto& l : layers) {
              auto r = cuda::MoeRunner::Create(*l, T, s.topk, cuda::Path::kNative);
              OK(r.status());
              runners.push_back(std::move(*r));
            }
            std::vector<int32_t> ids(size_t(T) * s.topk * layers.size());
            std::vector<float> w(ids.size(), 0.3f);
            benchutil::Rng rng(T);
            for (size_t i = 0; i < ids.size(); i += s.topk) {
              for (int k = 0; k < s.topk; ++k) {
                int e;
                bool dup;
                do {
                  e = static_cast<int>(rng.Next() % s.experts);
                  dup = false;
                  for (int j = 0; j < k; ++j) dup |= ids[i + j] == e;
                } while (dup);
                ids[i + k] = e;
              }
            }
            const auto x = RandomVector(size_t(T) * s.hidden, 9);
            float *dx, *dw, *dout;
            int32_t* dids;
            CK(cudaMalloc(&dx, x.size() * 4));
            CK(cudaMalloc(&dout, x.size() * 4));
            CK(cudaMalloc(&dids, ids.size() * 4));
            CK(cudaMalloc(&dw, w.size() * 4));
            CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
            const int nl = static_cast<int>(layers.size());
            auto step = [&](int) {
              for (int l = 0; l < nl; ++l)
                OK(runners[l]->Forward(l % 2 ? dout : dx, T, dids + size_t(l) * T * s.topk,
                                       dw + size_t(l) * T * s.topk, l % 2 ? dx : dout, g_stream, true));
            };
            step(0);
            CK(cudaStreamSynchronize(g_stream));
            const double t = TimeMedian(step, 1, 10);
            std::printf("stack of %d GLM-5.3-Flash MoE layers (K=2 mcg), T=%d: %.1f us per token step (%.1f us/layer)\n",
                        nl, T, t * 1e6, t * 1e6 / nl);
            char js[256];
            std::snprintf(js, sizeof js, "{\"bench\":\"moe-stack\",\"layers\":%d,\"T\":%d,\"step_us\":%.2f}", nl, T,
                          t * 1e6);
            Json(js);
            CK(cudaFree(dx));
            CK(cudaFree(dout));
            CK(cudaFree(dids));
            CK(cudaFree(dw));
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
void BenchGemm(const Ceilings& c) {
  std::printf("\n%-40s %10s %10s %10s %8s %10s %10s\n", "prefill GEMM (dequant fused)", "fused", "TFLOP/s",
              "cuBLAS*", "ratio", "reference", "native");
  std::printf("(fused = the fused GEMM kernel, forced; cuBLAS* = cublasGemmEx fp16 on the already-dequantised "
              "W_inner, same shape; reference = dequant + cuBLAS; native = LinearForward's rule: the fused GEMM "
              "below kLinearDequantGemmMinRows = %d rows, dequant + cuBLAS from there)\n",
              cuda::kLinearDequantGemmMinRows);
  cuda::Workspace ws;
  cublasHandle_t h;
  cublasCreate(&h);
  cublasSetStream(h, g_stream);
  for (int K : {2, 4}) {
    const int k = 4096, n = 14336;
    RandomLinear L(k, n, K, Codebook::kMcg, 500 + K);
    auto dev = cuda::DeviceLinear::Upload(L.view);
    OK(dev.status());
    __half* wd;
    CK(cudaMalloc(&wd, size_t(k) * n * 2));
    OK(cuda::DequantizeInnerDevice((*dev)->view(), reinterpret_cast<uint16_t*>(wd), g_stream));
    for (int m : {128, 256, 512, 1024, 2048, 4096, 8192}) {
      const auto x = RandomVector(size_t(m) * k, 21);
      float *dx, *dy;
      __half* da;
      CK(cudaMalloc(&dx, x.size() * 4));
      CK(cudaMalloc(&dy, size_t(m) * n * 4));
      CK(cudaMalloc(&da, size_t(m) * k * 2));
      CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
      auto call = [&](cuda::Path p) {
        return [&, p](int) { OK(cuda::LinearForward((*dev)->view(), dx, m, dy, &ws, g_stream, p)); };
      };
      call(cuda::Path::kNative)(0);
      call(cuda::Path::kReference)(0);
      CK(cudaStreamSynchronize(g_stream));
      const double tn = TimeMedian(call(cuda::Path::kNative), 1, 10);
      cuda::SetGemvPathOverride(3);
      const double t = TimeMedian(call(cuda::Path::kNative), 1, 10);
      cuda::SetGemvPathOverride(0);
      const double tr = TimeMedian(call(cuda::Path::kReference), 1, 5);
      const float al = 1, be = 0;
      const double tc = TimeMedian(
          [&](int) {
            cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &al, wd, CUDA_R_16F, n, da, CUDA_R_16F, k, &be, dy,
                         CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          },
          1, 10);
      const double flops = 2.0 * m * k * n;
      char name[96];
      std::snprintf(name, sizeof name, "m=%d %dx%d K=%d mcg", m, k, n, K);
      std::printf("%-40s %8.1fus %10.1f %8.1fus %7.0f%% %8.1fus %8.1fus\n", name, t * 1e6, flops / t * 1e-12,
                  tc * 1e6, 100.0 * tc / t, tr * 1e6, tn * 1e6);
      char js[384];
      std::snprintf(js, sizeof js,
                    "{\"bench\":\"gemm\",\"m\":%d,\"k\":%d,\"n\":%d,\"K\":%d,\"fused_us\":%.2f,\"tflops\":%.2f,"
                    "\"cublas_us\":%.2f,\"reference_us\":%.2f,\"native_us\":%.2f}",
                    m, k, n, K, t * 1e6, flops / t * 1e-12, tc * 1e6, tr * 1e6, tn * 1e6);
      Json(js);
      CK(cudaFree(dx));
      CK(cudaFree(dy));
      CK(cudaFree(da));
    }
    CK(cudaFree(wd));
  }
  cublasDestroy(h);
  (void)c;
  // Expert-grouped MoE prefill (GLM-5.3-Flash layer, K=2 MCG) against the reference path.
  ProjSpec p{2, Codebook::kMcg};
  RandomMoeLayer layer(4096, 2048, 288, 0, p, p, p, 2048, p, p, p, 10.0f, 77);
  auto dev = cuda::DeviceMoeLayer::Upload(layer.view);
  OK(dev.status());
  for (int T : {512, 2048}) {
    auto runner = cuda::MoeRunner::Create(**dev, T, 8, cuda::Path::kNative);
    OK(runner.status());
    auto refr = cuda::MoeRunner::Create(**dev, T, 8, cuda::Path::kReference);
    OK(refr.status());
    std::vector<int32_t> ids(size_t(T) * 8);
    std::vector<float> w(ids.size(), 0.2f);
    benchutil::Rng rng(T);
    for (size_t i = 0; i < ids.size(); i += 8)
      for (int k = 0; k < 8; ++k) {
        int e;
        bool dup;
        do {
          e = static_cast<int>(rng.Next() % 288);
          dup = false;
          for (int j = 0; j < k; ++j) dup |= ids[i + j] == e;
        } while (dup);
        ids[i + k] = e;
      }
    const auto x = RandomVector(size_t(T) * 4096, 5);
    float *dx, *dout, *dw;
    int32_t* dids;
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dout, x.size() * 4));
    CK(cudaMalloc(&dids, ids.size() * 4));
    CK(cudaMalloc(&dw, w.size() * 4));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    auto call = [&](cuda::MoeRunner* r) {
      return [&, r](int) { OK(r->Forward(dx, T, dids, dw, dout, g_stream, true)); };
    };
    call(runner->get())(0);
    CK(cudaStreamSynchronize(g_stream));
    const double t = TimeMedian(call(runner->get()), 1, 10);
    const double tr = TimeMedian(call(refr->get()), 1, 3, false);
    std::printf("MoE prefill GLM-5.3-Flash K=2 mcg T=%-5d native %8.1fus   reference %8.1fus   (%.2fx)\n", T, t * 1e6,
                tr * 1e6, tr / t);
    char js[256];
    std::snprintf(js, sizeof js, "{\"bench\":\"moe-prefill\",\"T\":%d,\"native_us\":%.2f,\"reference_us\":%.2f}", T,
                  t * 1e6, tr * 1e6);
    Json(js);
    CK(cudaFree(dx));
    CK(cudaFree(dout));
    CK(cudaFree(dids));
    CK(cudaFree(dw));
  }
}

int Main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-bench")) return 0;
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::printf(
        "usage: exl3-bench ceiling|gemv|moe|gemm|all [--json FILE] [--stack N]\n"
        "Times the EXL3 CUDA kernels against their floors (see the header of exl3_bench.cc).\n");
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  std::string json_path;
  int stack = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--stack" && i + 1 < argc) {
      stack = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "exl3-bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (cmd != "ceiling" && cmd != "gemv" && cmd != "moe" && cmd != "gemm" && cmd != "all") {
    std::fprintf(stderr, "exl3-bench: unknown subcommand %s\n", cmd.c_str());
    return 2;
  }
  if (cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "exl3-bench: no CUDA device\n");
    return 2;
  }
  auto info = cuda::QueryDevice(0);
  OK(info.status());
  std::printf("device: %s, cc %d.%d, %d SMs, L2 %zu MB\n", info->name.c_str(), info->cc_major, info->cc_minor,
              info->sm_count, info->l2_bytes >> 20);
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  const Ceilings c = MeasureCeilings(cmd == "ceiling" || cmd == "all");
  if (cmd == "gemv" || cmd == "all") BenchGemv(c);
  if (cmd == "moe" || cmd == "all") BenchMoe(c, stack);
  if (cmd == "gemm" || cmd == "all") BenchGemm(c);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "exl3-bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < g_json.size(); ++i) std::fprintf(f, "  %s%s\n", g_json[i].c_str(), i + 1 < g_json.size() ? "," : "");
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace exl3

int main(int argc, char** argv) { return exl3::Main(argc, argv); }
