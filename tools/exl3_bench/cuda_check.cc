// exl3-cuda-check: correctness of the CUDA kernels against the CPU reference, on the GPU machine.
// Fresh random inputs every case, outputs poisoned (NaN) before every run, every K and codebook,
// shapes on tile edges, many token counts, random and adversarial routing, graph replay.
// Prints one line per case and the worst ‖out−ref‖/‖ref‖ per kernel; exits 1 on any failure.
// Not a ctest test: CI builds it but has no GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "base/command_line.h"
#include "kernels/cuda/bench_hooks.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/gemv_plan.h"
#include "kernels/cuda/moe_cooperative.h"
#include "kernels/exl3_linear.h"
#include "kernels/moe_classes.h"
#include "kernels/moe_cpu.h"
#include "tools/exl3_bench/exit_on_error.h"
#include "tools/exl3_bench/random_exl3.h"

namespace exl3 {

constexpr int kSkipped = 77;  // no GPU here

namespace {

using benchutil::ProjSpec;
using benchutil::RandomLinear;
using benchutil::RandomMoeLayer;
using benchutil::RandomVector;
using benchutil::RelErr;

std::map<std::string, double> g_worst;
std::map<std::string, double> g_limit = {
    {"gemv", 4e-3}, {"gemm", 4e-3}, {"dequant-gemm", 4e-3}, {"linear-reference", 4e-3}, {"linear-shared", 4e-3},
    {"moe-native", 1e-2},
    {"moe-native-prefill", 1e-2}, {"moe-reference", 1e-2}, {"moe-graph-replay", 1e-2},
    {"moe-registered-host", 1e-2},
    // Layers whose routed experts differ in K and codebook (ExpertSpecCycles): the same checks.
    {"moe-mixed-native", 1e-2}, {"moe-mixed-prefill", 1e-2}, {"moe-mixed-reference", 1e-2},
    {"moe-mixed-graph", 1e-2}, {"moe-mixed-registered", 1e-2}, {"moe-mixed-classes", 0},
    // The one-launch cooperative decode (kernels/cuda/moe_cooperative.cu) beside the chain
    // ("moe-native" is the chain, forced), and the rule that picks it (0: the expected sequence).
    {"moe-cooperative", 1e-2}, {"moe-coop-graph", 1e-2}, {"moe-coop-registered", 1e-2},
    {"moe-mixed-cooperative", 1e-2}, {"moe-mixed-coop-graph", 1e-2}, {"moe-mixed-coop-registered", 1e-2},
    {"moe-coop-choice", 0}};
int g_failures = 0;
int g_cases = 0;
uint64_t g_seed = 1;

void Record(const std::string& kernel, double err, const std::string& what) {
  ++g_cases;
  double& w = g_worst[kernel];
  w = std::max(w, err);
  const bool ok = err <= g_limit[kernel];
  if (!ok) ++g_failures;
  std::printf("%-20s %-60s rel_err %.3e %s\n", kernel.c_str(), what.c_str(), err, ok ? "ok" : "FAIL");
}

// Host <-> device copies through a pinned staging buffer: a heap vector can share a page with the
// layer tensors of a registered-host case (DeviceMoeLayer::Register pins whole pages), and
// cudaMemcpy refuses (cudaErrorInvalidValue) a pageable range that straddles a registered one.
void Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  static void* stage = nullptr;
  static size_t cap = 0;
  if (bytes > cap) {
    if (stage) CK(cudaFreeHost(stage));
    CK(cudaMallocHost(&stage, bytes));
    cap = bytes;
  }
  if (kind == cudaMemcpyHostToDevice) {
    std::memcpy(stage, src, bytes);
    CK(cudaMemcpy(dst, stage, bytes, kind));
  } else {
    CK(cudaMemcpy(stage, src, bytes, kind));
    std::memcpy(dst, stage, bytes);
  }
}
template <typename T>
void Upload(T* dst, const std::vector<T>& v) {
  Copy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
}

template <typename T>
T* DevCopy(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(v.size() * sizeof(T), 16)));
  Upload(p, v);
  return p;
}

std::vector<float> Fetch(const float* d, size_t n) {
  std::vector<float> v(n);
  Copy(v.data(), d, n * 4, cudaMemcpyDeviceToHost);
  return v;
}

// Runs fn(begin, end) over [0, n) split across the machine's cores (the CPU references are
// single-threaded and independent per row/token).
template <typename F>
void ParallelRows(int n, F fn) {
  const int threads = std::max(1, std::min<int>(n, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    const int b = static_cast<int>(static_cast<long>(n) * i / threads);
    const int e = static_cast<int>(static_cast<long>(n) * (i + 1) / threads);
    if (b < e) pool.emplace_back([=] { fn(b, e); });
  }
  for (auto& t : pool) t.join();
}

// ---------------------------------------------------------------------------------------------
// slice > 0 forces the one-launch GEMV's k-slice length (16-row tiles; bench_hooks.h); gemv_path
// 1 / 2 / 3 forces the one-launch GEMV / the three-launch GEMV / the GEMM for m <= kGemvMaxRows
// (0: LinearForward's shape rule).
void CheckLinear(int k, int n, int K, Codebook cb, const std::vector<int>& ms, bool bias,
                 cuda::Workspace* ws, int slice = 0, int gemv_path = 0) {
  cuda::SetDenseGemvSliceOverride(slice);
  cuda::SetGemvPathOverride(gemv_path);
  const std::string slice_note = (slice > 0 ? " slice=" + std::to_string(slice) : "") +
                                 (gemv_path == 1 ? " 1-launch" : gemv_path == 2 ? " 3-launch" : gemv_path == 3 ? " gemm" : "");
  RandomLinear L(k, n, K, cb, g_seed++, bias);
  auto dev = cuda::DeviceLinear::Upload(L.view);
  OK(dev.status());
  const std::string shape = std::to_string(k) + "x" + std::to_string(n) + " K" + std::to_string(K) + " " +
                            std::string(CodebookName(cb)) + (bias ? " bias" : "");
  // Dequantisation: bit-exact.
  {
    std::vector<uint16_t> ref(static_cast<size_t>(k) * n), got(ref.size());
    DequantizeInner(L.view, ref.data());
    uint16_t* d = nullptr;
    CK(cudaMalloc(&d, ref.size() * 2));
    CK(cudaMemset(d, 0xff, ref.size() * 2));
    OK(cuda::DequantizeInnerDevice((*dev)->view(), d));
    CK(cudaDeviceSynchronize());
    Copy(got.data(), d, ref.size() * 2, cudaMemcpyDeviceToHost);
    CK(cudaFree(d));
    size_t bad = 0;
    for (size_t i = 0; i < ref.size(); ++i) bad += ref[i] != got[i];
    ++g_cases;
    g_worst["dequant-mismatches"] = std::max<double>(g_worst["dequant-mismatches"], bad);
    if (bad) ++g_failures;
    std::printf("%-20s %-60s mismatches %zu of %zu %s\n", "dequant", shape.c_str(), bad, ref.size(),
                bad ? "FAIL" : "ok");
  }
  for (int m : ms) {
    const auto x = RandomVector(static_cast<size_t>(m) * k, g_seed++);
    std::vector<float> ref(static_cast<size_t>(m) * n);
    ParallelRows(m, [&](int b, int e) {
      LinearForwardReference(L.view, x.data() + static_cast<size_t>(b) * k, e - b, ref.data() + static_cast<size_t>(b) * n);
    });
    float* dx = DevCopy(x);
    float* dy = nullptr;
    CK(cudaMalloc(&dy, ref.size() * 4));
    // The native GEMV runs twice: its workspace must be left zero for the next call.
    const bool gemm = gemv_path == 3 || m > cuda::kGemvMaxRows || (gemv_path == 0 && m > cuda::kLinearGemvMaxRows);
    const int native_runs = gemm ? 1 : 2;
    for (cuda::Path p : {cuda::Path::kNative, cuda::Path::kReference}) {
      for (int run = 0; run < (p == cuda::Path::kNative ? native_runs : 1); ++run) {
        CK(cudaMemset(dy, 0xff, ref.size() * 4));
        OK(cuda::LinearForward((*dev)->view(), dx, m, dy, ws, nullptr, p));
        CK(cudaDeviceSynchronize());
        const auto got = Fetch(dy, ref.size());
        const std::string kernel = p == cuda::Path::kReference                      ? "linear-reference"
                                   : gemv_path != 3 && cuda::UseDequantGemm(m) ? "dequant-gemm"
                                   : gemm                                       ? "gemm"
                                                                                : "gemv";
        Record(kernel, RelErr(got.data(), ref.data(), ref.size()),
               shape + slice_note + " m=" + std::to_string(m) + (run ? " again" : ""));
      }
    }
    CK(cudaFree(dx));
    CK(cudaFree(dy));
  }
  cuda::SetDenseGemvSliceOverride(0);
  cuda::SetGemvPathOverride(0);
}

// LinearForwardShared: layers of one input (an attention layer's q, k, v) against the CPU
// reference of each. ns: their output widths; ks: their bit widths (different ones take the
// one-by-one path); biases on the second.
void CheckLinearShared(int k, const std::vector<int>& ns, const std::vector<int>& ks, Codebook cb,
                       const std::vector<int>& ms, cuda::Workspace* ws) {
  const int count = static_cast<int>(ns.size());
  std::vector<std::unique_ptr<RandomLinear>> layers;
  std::vector<std::unique_ptr<cuda::DeviceLinear>> devs;
  std::vector<const Exl3LinearView*> views;
  std::string shape = std::to_string(k) + "x{";
  for (int i = 0; i < count; ++i) {
    layers.push_back(std::make_unique<RandomLinear>(k, ns[i], ks[i], cb, g_seed++, i == 1));
    auto dev = cuda::DeviceLinear::Upload(layers.back()->view);
    OK(dev.status());
    devs.push_back(std::move(*dev));
    views.push_back(&devs.back()->view());
    shape += (i ? "," : "") + std::to_string(ns[i]) + " K" + std::to_string(ks[i]);
  }
  shape += "} " + std::string(CodebookName(cb));
  for (int m : ms) {
    const auto x = RandomVector(static_cast<size_t>(m) * k, g_seed++);
    float* dx = DevCopy(x);
    std::vector<float*> dy(count);
    std::vector<std::vector<float>> ref(count);
    for (int i = 0; i < count; ++i) {
      ref[i].resize(static_cast<size_t>(m) * ns[i]);
      LinearForwardReference(layers[i]->view, x.data(), m, ref[i].data());
      CK(cudaMalloc(&dy[i], ref[i].size() * 4));
      CK(cudaMemset(dy[i], 0xff, ref[i].size() * 4));
    }
    OK(cuda::LinearForwardShared(views.data(), count, dx, m, dy.data(), ws));
    CK(cudaDeviceSynchronize());
    for (int i = 0; i < count; ++i) {
      const auto got = Fetch(dy[i], ref[i].size());
      Record("linear-shared", RelErr(got.data(), ref[i].data(), ref[i].size()),
             shape + " layer " + std::to_string(i) + " m=" + std::to_string(m));
      CK(cudaFree(dy[i]));
    }
    CK(cudaFree(dx));
  }
}

// ---------------------------------------------------------------------------------------------
enum class Routing { kRandom, kAllToOne, kRepeatedWeights, kDuplicatesAndInvalid };
const char* RoutingName(Routing r) {
  switch (r) {
    case Routing::kRandom: return "random";
    case Routing::kAllToOne: return "all-tokens-same-experts";
    case Routing::kRepeatedWeights: return "repeated-weights";
    case Routing::kDuplicatesAndInvalid: return "duplicate+invalid-ids";
  }
  return "?";
}

void MakeRouting(Routing kind, int T, int topk, int E, std::vector<int32_t>* ids, std::vector<float>* w) {
  benchutil::Rng rng(g_seed++);
  ids->resize(static_cast<size_t>(T) * topk);
  w->resize(ids->size());
  for (int t = 0; t < T; ++t) {
    std::vector<int> chosen;
    for (int k = 0; k < topk; ++k) {
      int e;
      if (kind == Routing::kAllToOne) {
        e = k;
      } else {
        do {
          e = static_cast<int>(rng.Next() % E);
        } while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
      }
      chosen.push_back(e);
      (*ids)[t * topk + k] = e;
      (*w)[t * topk + k] = kind == Routing::kRepeatedWeights ? 1.0f / topk : 0.05f + rng.Uniform();
    }
    if (kind == Routing::kDuplicatesAndInvalid && topk >= 3) {
      (*ids)[t * topk + 1] = (*ids)[t * topk];  // same expert twice
      (*ids)[t * topk + 2] = (t & 1) ? -1 : E + 3;  // out of range: skipped
    }
  }
}

// The CPU judge: drops ids out of range or not held (as the kernels do).
std::vector<float> MoeReference(const MoeLayerView& layer, const std::vector<float>& x, int T, int topk,
                                const std::vector<int32_t>& ids, const std::vector<float>& w, bool shared) {
  std::vector<int32_t> fid, off{0};
  std::vector<float> fw;
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < topk; ++k) {
      const int e = ids[t * topk + k];
      if (e < 0 || e >= layer.num_experts() || layer.experts[e] == nullptr) continue;
      fid.push_back(e);
      fw.push_back(w[t * topk + k]);
    }
    off.push_back(static_cast<int32_t>(fid.size()));
  }
  std::vector<float> y(static_cast<size_t>(T) * layer.hidden_size);
  const int H = layer.hidden_size;
  ParallelRows(T, [&](int b, int e) {
    std::vector<int32_t> o(off.begin() + b, off.begin() + e + 1);
    for (auto& v : o) v -= off[b];
    MoeAssignments a;
    a.num_tokens = e - b;
    a.expert_ids = fid.data() + off[b];
    a.weights = fw.data() + off[b];
    a.offsets = o.data();
    OK(MoeForwardReference(layer, x.data() + static_cast<size_t>(b) * H, a, shared, y.data() + static_cast<size_t>(b) * H));
  });
  return y;
}

struct MoeCase {
  const char* name;
  int hidden, inter, experts, held_every, topk, shared_inter;
  ProjSpec g, u, d, sg, su, sd;
  float limit;
  bool bias, shared_gate;
  // Per-expert (K, codebook) of the routed experts (overrides g, u, d where set).
  benchutil::ExpertSpecCycles cycles = {};
  bool mixed() const { return !cycles.gate.empty() || !cycles.up.empty() || !cycles.down.empty(); }
};

// A copy of `v` whose every tensor starts 8 bytes past a 16-byte boundary, as tensors of a
// safetensors file mapped in place may (the format aligns data to 8 bytes only).
struct MisalignedCopy {
  std::vector<std::unique_ptr<uint8_t[]>> buffers;
  std::deque<ExpertMlp> mlps;
  MoeLayerView view;
  explicit MisalignedCopy(const MoeLayerView& v) : view(v) {
    auto copy = [&](const void* src, size_t bytes) -> const void* {
      if (src == nullptr) return nullptr;
      buffers.emplace_back(new uint8_t[bytes + 32]);
      uint8_t* p = buffers.back().get();
      p += (24 - reinterpret_cast<uintptr_t>(p) % 16) % 16;  // p % 16 == 8
      std::memcpy(p, src, bytes);
      return p;
    };
    auto linear = [&](Exl3LinearView l) {
      l.trellis = static_cast<const uint16_t*>(copy(l.trellis, l.trellis_words() * 2));
      l.suh = static_cast<const uint16_t*>(copy(l.suh, l.in_features * 2ul));
      l.svh = static_cast<const uint16_t*>(copy(l.svh, l.out_features * 2ul));
      l.bias = static_cast<const uint16_t*>(copy(l.bias, l.out_features * 2ul));
      return l;
    };
    auto mlp = [&](const ExpertMlp* m) -> const ExpertMlp* {
      if (m == nullptr) return nullptr;
      mlps.push_back(ExpertMlp{linear(m->gate), linear(m->up), linear(m->down)});
      return &mlps.back();
    };
    for (auto& e : view.experts) e = mlp(e);
    view.shared = mlp(view.shared);
    view.shared_gate = static_cast<const float*>(copy(view.shared_gate, v.hidden_size * 4ul));
  }
};

// registered: the weights stay in (pinned, mapped) host memory, only the tables go to the device;
// misaligned: and those host tensors are 8 but not 16-byte aligned (copied to the device instead).
// all_routings_up_to: above this T only the random routing with the shared expert runs (the CPU
// judge decodes every expert's weights per token: a prefill-sized T is slow on it).
void CheckMoe(const MoeCase& c, const std::vector<int>& token_counts, bool with_reference, bool graph,
              bool registered = false, bool misaligned = false, int all_routings_up_to = 1 << 30) {
  RandomMoeLayer layer(c.hidden, c.inter, c.experts, c.held_every, c.g, c.u, c.d, c.shared_inter, c.sg, c.su, c.sd,
                       c.limit, g_seed++, c.bias, c.shared_gate, c.cycles);
  // A mixed case's labels are "moe-mixed-*", and it must have made more than one class
  // (kernels/moe_classes.h): "moe-mixed-classes" fails otherwise.
  auto label = [&](const std::string& kernel) -> std::string {
    if (!c.mixed()) return kernel;
    static const std::map<std::string, std::string> mixed = {
        {"moe-native", "moe-mixed-native"},       {"moe-native-prefill", "moe-mixed-prefill"},
        {"moe-reference", "moe-mixed-reference"}, {"moe-graph-replay", "moe-mixed-graph"},
        {"moe-registered-host", "moe-mixed-registered"}, {"moe-cooperative", "moe-mixed-cooperative"},
        {"moe-coop-graph", "moe-mixed-coop-graph"},      {"moe-coop-registered", "moe-mixed-coop-registered"}};
    return mixed.at(kernel);
  };
  std::string name = c.name;
  if (c.mixed()) {
    auto classes = ClassifyMoeExperts(layer.view);
    OK(classes.status());
    name += " [" + std::to_string(classes->num_classes()) + " classes]";
    Record("moe-mixed-classes", classes->num_classes() > 1 ? 0.0 : 1.0, name + " has more than one class");
  }
  std::unique_ptr<MisalignedCopy> shifted;
  if (misaligned) shifted = std::make_unique<MisalignedCopy>(layer.view);
  auto dev = !registered ? cuda::DeviceMoeLayer::Upload(layer.view)
                         : cuda::DeviceMoeLayer::Register(misaligned ? shifted->view : layer.view);
  OK(dev.status());
  if (misaligned) OK((*dev)->copied_bytes() > 0 ? absl::OkStatus() : absl::InternalError("nothing copied"));
  const int max_t = *std::max_element(token_counts.begin(), token_counts.end());
  // "moe-native": the launch chain (forced); "moe-cooperative": the cooperative decode asked for
  // (the engine's rule takes it only with EXL3_MOE_COOP=1), which its cover rule still sends to the
  // chain where it does not cover T (checked against the expected choice).
  auto native = cuda::MoeRunner::Create(**dev, max_t, c.topk, cuda::Path::kNative);
  OK(native.status());
  (*native)->ForceSequence(cuda::MoeSequence::kChain);
  auto coop = cuda::MoeRunner::Create(**dev, max_t, c.topk, cuda::Path::kNative);
  OK(coop.status());
  (*coop)->ForceSequence(cuda::MoeSequence::kCooperative);
  std::unique_ptr<cuda::MoeRunner> reference;
  if (with_reference) {
    auto r = cuda::MoeRunner::Create(**dev, max_t, c.topk, cuda::Path::kReference);
    OK(r.status());
    reference = std::move(*r);
  }
  const int H = c.hidden;
  float* dx = nullptr;
  float* dout = nullptr;
  int32_t* dids = nullptr;
  float* dw = nullptr;
  CK(cudaMalloc(&dx, static_cast<size_t>(max_t) * H * 4));
  CK(cudaMalloc(&dout, static_cast<size_t>(max_t) * H * 4));
  CK(cudaMalloc(&dids, static_cast<size_t>(max_t) * c.topk * 4));
  CK(cudaMalloc(&dw, static_cast<size_t>(max_t) * c.topk * 4));
  for (int T : token_counts) {
    std::string why;
    const bool coop_covers = (*coop)->SequenceFor(T, &why) == cuda::MoeSequence::kCooperative;
    const bool coop_expected = T <= cuda::kMoeCoopMaxTokens && T * c.topk <= cuda::kMoeCoopMaxAssign;
    Record("moe-coop-choice", coop_covers == coop_expected ? 0.0 : 1.0,
           name + " T=" + std::to_string(T) + ": " + cuda::MoeSequenceName(coop_covers ? cuda::MoeSequence::kCooperative
                                                                                      : cuda::MoeSequence::kChain) +
               " (" + why + ")");
    for (Routing kind : {Routing::kRandom, Routing::kAllToOne, Routing::kRepeatedWeights,
                         Routing::kDuplicatesAndInvalid}) {
      if (T > all_routings_up_to && kind != Routing::kRandom) continue;
      for (bool shared : {true, false}) {
        if (!shared && (kind != Routing::kRandom || c.shared_inter == 0 || T > all_routings_up_to)) continue;
        const auto x = RandomVector(static_cast<size_t>(T) * H, g_seed++);
        std::vector<int32_t> ids;
        std::vector<float> w;
        MakeRouting(kind, T, c.topk, c.experts, &ids, &w);
        const auto ref = MoeReference(layer.view, x, T, c.topk, ids, w, shared);
        Upload(dx, x);
        Upload(dids, ids);
        Upload(dw, w);
        const std::string what = name + " T=" + std::to_string(T) + " " + RoutingName(kind) +
                                 (shared ? "" : " no-shared");
        CK(cudaMemset(dout, 0xff, ref.size() * 4));
        OK((*native)->Forward(dx, T, dids, dw, dout, nullptr, shared));
        CK(cudaDeviceSynchronize());
        auto got = Fetch(dout, ref.size());
        Record(label(registered                     ? "moe-registered-host"
                     : T > cuda::kMoeGemvMaxTokens ? "moe-native-prefill"
                                                   : "moe-native"),
               RelErr(got.data(), ref.data(), ref.size()), what);
        if (coop_covers) {
          CK(cudaMemset(dout, 0xff, ref.size() * 4));
          OK((*coop)->Forward(dx, T, dids, dw, dout, nullptr, shared));
          CK(cudaDeviceSynchronize());
          got = Fetch(dout, ref.size());
          Record(label(registered ? "moe-coop-registered" : "moe-cooperative"),
                 RelErr(got.data(), ref.data(), ref.size()), what);
        }
        if (reference) {
          CK(cudaMemset(dout, 0xff, ref.size() * 4));
          OK(reference->ForwardHostRouting(dx, T, ids.data(), w.data(), dout, nullptr, shared));
          CK(cudaDeviceSynchronize());
          got = Fetch(dout, ref.size());
          Record(label("moe-reference"), RelErr(got.data(), ref.data(), ref.size()), what);
        }
      }
    }
    // Capture once, replay with new inputs written into the same device buffers: the chain, and
    // the cooperative launch where it covers T (a cooperative kernel node).
    auto replay = [&](cuda::MoeRunner* runner, const std::string& kernel) {
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      OK(runner->Forward(dx, T, dids, dw, dout, s, true));
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int rep = 0; rep < 3; ++rep) {
        const auto x = RandomVector(static_cast<size_t>(T) * H, g_seed++);
        std::vector<int32_t> ids;
        std::vector<float> w;
        MakeRouting(rep == 1 ? Routing::kAllToOne : Routing::kRandom, T, c.topk, c.experts, &ids, &w);
        const auto ref = MoeReference(layer.view, x, T, c.topk, ids, w, true);
        Upload(dx, x);
        Upload(dids, ids);
        Upload(dw, w);
        CK(cudaMemset(dout, 0xff, ref.size() * 4));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        const auto got = Fetch(dout, ref.size());
        Record(label(kernel), RelErr(got.data(), ref.data(), ref.size()),
               name + " T=" + std::to_string(T) + " replay " + std::to_string(rep));
      }
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      CK(cudaStreamDestroy(s));
    };
    if (graph && T <= cuda::kMoeGemvMaxTokens) replay(native->get(), "moe-graph-replay");
    if (graph && coop_covers) replay(coop->get(), "moe-coop-graph");
  }
  CK(cudaFree(dx));
  CK(cudaFree(dout));
  CK(cudaFree(dids));
  CK(cudaFree(dw));
}

// Routed experts of one projection that differ in K and codebook (MoeCase::cycles): the native
// path runs each (K, codebook) class's chunks in the launch of its own kernel instance
// (kernels/cuda/moe_runner.cu). GEMV token counts (T <= kMoeGemvMaxTokens) and GEMM ones (65,
// 300), on the native and the reference path, graph replay, registered host memory.
void CheckMixedExperts(bool small, bool big) {
  using benchutil::ExpertSpecCycles;
  const ProjSpec k1m{1, Codebook::kMcg}, k2m{2, Codebook::kMcg}, k3i{3, Codebook::k3Inst}, k4u{4, Codebook::kMul1},
      k5u{5, Codebook::kMul1}, k6i{6, Codebook::k3Inst}, k7m{7, Codebook::kMcg}, k8u{8, Codebook::kMul1},
      k3m{3, Codebook::kMcg}, k4m{4, Codebook::kMcg}, k2i{2, Codebook::k3Inst}, k3u{3, Codebook::kMul1};
  const std::vector<int> gemv_gemm = {1, 8, 64, 65, 300};
  // Whole experts at K 2, 3 or 4 (one codebook), the shared expert at K 4: 3 classes, the shared
  // expert's problems in the K = 4 launch.
  MoeCase whole{"per-expert K2/3/4 mcg (shared gate)", 512, 256, 32, 0, 8, 256, k2m, k2m, k2m, k4m, k4m, k4m,
                0.0f, false, true, ExpertSpecCycles{{k2m, k3m, k4m}, {k2m, k3m, k4m}, {k2m, k3m, k4m}}};
  if (small) {
    CheckMoe(whole, {3, 70}, true, false);
    return;
  }
  // Every K 1..8 and all three codebooks: gate and up cycle with period 4, down with period 3
  // (12 classes; several share a gate (K, codebook), so some launches take more than kMaxProblems
  // problems' worth and split), experts not held, bias, clamp.
  MoeCase every{"per-expert K1..8/3inst/mcg/mul1+bias+limit", 256, 384, 24, 5, 6, 256, k2m, k2m, k2m, k4m, k2i,
                k3u, 0.75f, true, false,
                ExpertSpecCycles{{k1m, k2m, k3i, k4u}, {k2m, k2m, k3i, k5u}, {k6i, k7m, k8u}}};
  // Only down's codebook varies (K 3), no shared expert.
  MoeCase cbs{"per-expert down codebook, no shared", 256, 256, 16, 0, 4, 0, k2m, k2m, k3i, k2m, k2m, k2m, 0.0f,
              false, false, ExpertSpecCycles{{}, {}, {k3i, k3m, k3u}}};
  for (const MoeCase* c : {&whole, &every, &cbs}) CheckMoe(*c, gemv_gemm, true, true);
  CheckMoe(every, {1, 65}, false, false, /*registered=*/true);
  CheckMoe(every, {8}, false, false, /*registered=*/true, /*misaligned=*/true);
  if (big) {
    MoeCase glm{"glm-like 2048/1024 E64 top8 per-expert K2/3 mcg/3inst", 2048, 1024, 64, 0, 8, 1024, k2m, k2m,
                k2m, k2m, k2m, k2m, 10.0f, false, false,
                ExpertSpecCycles{{k2m, k3i}, {k2m, k3i}, {k3m, k2m, k2i}}};
    CheckMoe(glm, gemv_gemm, true, true);
  }
}

// The one-launch cooperative decode (kernels/cuda/moe_cooperative.cu) at tile edges: every K and
// codebook (a uniform layer each, alternating shared expert, biases, the clamp, experts not held,
// top-k), T across the 8-row chunk edge and the bound (kMoeCoopMaxTokens; 17 runs the chain),
// every T up to the bound on one layer, graph replay, and a top-k whose T * top_k passes
// kMoeCoopMaxAssign before the token bound (the rule falls back to the chain there). Every call
// also runs the chain (forced) and compares both with the CPU reference; the mixed-class layers
// are CheckMixedExperts's.
void CheckCooperativeMoe(bool small) {
  const Codebook cbs[] = {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1};
  const std::vector<int> edges = small ? std::vector<int>{1, 9} : std::vector<int>{1, 2, 7, 8, 9, 15, 16, 17};
  for (int K = 1; K <= 8; ++K) {
    for (Codebook cb : cbs) {
      if (small && (K != 3 || cb != Codebook::kMcg)) continue;  // the sanitizer runs --small
      const ProjSpec p{K, cb};
      const int v = K * 3 + static_cast<int>(cb);
      const std::string name = "coop K" + std::to_string(K) + " " + std::string(CodebookName(cb));
      static std::deque<std::string> names;  // MoeCase keeps a const char*
      names.push_back(name + (v % 2 ? " +shared" : "") + (v % 3 == 0 ? " +bias" : "") + (v % 4 == 1 ? " +limit" : ""));
      MoeCase c{names.back().c_str(), 256, 384, 12 + v % 5, v % 3 == 2 ? 5 : 0, 3 + v % 4, v % 2 ? 256 : 0,
                p, p, p, p, p, p, v % 4 == 1 ? 0.75f : 0.0f, v % 3 == 0, v % 2 == 1 && v % 7 == 3};
      CheckMoe(c, edges, false, K == 3 || K == 8);
    }
  }
  if (small) return;
  std::vector<int> every_t;
  for (int T = 1; T <= cuda::kMoeCoopMaxTokens + 1; ++T) every_t.push_back(T);
  MoeCase uniform{"coop 512/256 E32 top8 K2 mcg shared", 512, 256, 32, 0, 8, 256, {2, Codebook::kMcg},
                  {2, Codebook::kMcg}, {2, Codebook::kMcg}, {3, Codebook::k3Inst}, {3, Codebook::k3Inst},
                  {4, Codebook::kMul1}, 7.0f, true, false};
  CheckMoe(uniform, every_t, true, true);
  // top 20: T = 12 is 240 assignments (cooperative), T = 13 260 (the chain).
  MoeCase wide{"coop top20 (assignment bound)", 256, 256, 40, 0, 20, 128, {4, Codebook::kMcg}, {4, Codebook::kMcg},
               {4, Codebook::kMcg}, {4, Codebook::kMcg}, {4, Codebook::kMcg}, {4, Codebook::kMcg}, 0.0f, false, false};
  CheckMoe(wide, {1, 12, 13}, false, true);
}

// The MoE launch chain at prefill token counts (scripts/gpu/prefill_checks.sh): MoeInputKernel
// (which zeroes the projections' outputs only for the GEMV) and MoeMidKernel (the routed and the
// shared expert's tables chosen by value) at T = 1, 7 (the GEMV), 64 (the GEMV's last), 65 (the
// GEMM's first) and 1024, with biases, the clamp, experts not held and the shared expert, on the
// native chain and the reference path; a GLM-5.3-Flash-like layer (top 8 of 32, clamped, one
// shared expert) likewise. Above T = 65 only the random routing runs (the CPU judge is slow).
// small (for compute-sanitizer): the first layer at T = 3 and 70 only.
void CheckMoePrefill(bool small) {
  MoeCase mixed{"prefill mixed-K/cb+bias+limit", 256, 384, 16, 4, 4, 256, {2, Codebook::kMcg}, {3, Codebook::k3Inst},
                {4, Codebook::kMul1}, {5, Codebook::kMcg}, {2, Codebook::kMul1}, {3, Codebook::kMcg}, 0.75f, true,
                false};
  if (small) {
    CheckMoe(mixed, {3, 70}, false, false);
    return;
  }
  CheckMoe(mixed, {1, 7, 64, 65, 1024}, true, true, false, false, 65);
  MoeCase glm{"prefill glm-like 512/256 E32 top8 K2 mcg shared", 512, 256, 32, 0, 8, 256, {2, Codebook::kMcg},
              {2, Codebook::kMcg}, {2, Codebook::kMcg}, {2, Codebook::kMcg}, {2, Codebook::kMcg},
              {2, Codebook::kMcg}, 10.0f, false, false};
  CheckMoe(glm, {1, 64, 65, 1024}, true, false, false, false, 65);
}

int Main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-cuda-check")) return 0;
  bool small = false, big = true, mixed_only = false, coop_only = false, moe_prefill = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: exl3-cuda-check [--small] [--no-big] [--mixed-experts] [--cooperative] [--moe-prefill] [--seed N]\n"
          "Checks the CUDA kernels against the CPU reference on random inputs; exits 1 on failure.\n"
          "  --small          a short sweep (for compute-sanitizer)\n"
          "  --no-big         skip the model-sized shapes\n"
          "  --mixed-experts  only the MoE layers whose routed experts differ in K and codebook\n"
          "  --cooperative    only the one-launch cooperative MoE decode's sweep\n"
          "  --moe-prefill    only the MoE launch chain at T = 1, 7, 64, 65 and 1024 (--small: 3 and 70)\n");
      return 0;
    } else if (a == "--small") {
      small = true;
    } else if (a == "--no-big") {
      big = false;
    } else if (a == "--mixed-experts") {
      mixed_only = true;
    } else if (a == "--cooperative") {
      coop_only = true;
    } else if (a == "--moe-prefill") {
      moe_prefill = true;
    } else if (a == "--seed" && i + 1 < argc) {
      g_seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "exl3-cuda-check: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (cuda::DeviceCount() == 0) {
    // 77: ctest's SKIP_RETURN_CODE for this test (tools/exl3_bench/CMakeLists.txt).
    std::fprintf(stderr, "exl3-cuda-check: no CUDA device: skipped\n");
    return kSkipped;
  }
  auto info = cuda::QueryDevice(0);
  OK(info.status());
  std::printf("device: %s, cc %d.%d, %d SMs, L2 %zu MB\n", info->name.c_str(), info->cc_major, info->cc_minor,
              info->sm_count, info->l2_bytes >> 20);
  cuda::Workspace ws;
  const Codebook cbs[] = {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1};
  if (moe_prefill) {
    CheckMoePrefill(small);
  } else if (coop_only) {
    CheckCooperativeMoe(small);
  } else if (mixed_only) {
    CheckMixedExperts(small, big);
  } else if (small) {
    for (int K : {2, 5})
      for (Codebook cb : cbs) CheckLinear(128, 256, K, cb, {1, 17, 130}, K == 5, &ws);
    CheckLinear(384, 640, 3, Codebook::kMcg, {1, 8, 20}, true, &ws, 3);  // slices across 128-blocks
    CheckLinearShared(256, {512, 128, 128}, {4, 4, 4}, Codebook::kMcg, {1, 8}, &ws);
    MoeCase c{"small", 256, 256, 8, 4, 3, 128, {2, Codebook::kMcg}, {3, Codebook::k3Inst}, {4, Codebook::kMul1},
              {2, Codebook::kMcg}, {2, Codebook::kMcg}, {3, Codebook::kMul1}, 1.0f, true, false};
    CheckMoe(c, {3, 70}, true, false);
    CheckMoe(c, {3}, false, false, /*registered=*/true);
    CheckMixedExperts(true, false);
    CheckCooperativeMoe(true);
  } else {
    // Every K and codebook on tile-edge shapes and token counts (GEMV <= 48 rows, GEMM above).
    for (int K = 1; K <= 8; ++K)
      for (Codebook cb : cbs) {
        CheckLinear(128, 128, K, cb, {1, 2, 3, 7, 8, 17, 64, 256}, false, &ws);
        CheckLinear(256, 384, K, cb, {1, 8, 33, 130, 1024}, K % 2 == 1, &ws);
        CheckLinear(384, 256, K, cb, {5, 16, 48, 49}, false, &ws);
        CheckLinear(640, 1152, K, cb, {1, 3, 9}, K == 2, &ws, 1 + (K * 5) % 24);
        // The three-launch GEMV (the shape rule's choice at large layers with m >= 2) at every K
        // and codebook.
        CheckLinear(640, 1152, K, cb, {1, 2, 9, 48}, K == 3, &ws, 0, 2);
        // The GEMM in k-slices (GemmKStages: 9 units alone here), forced at decode row counts and
        // chosen above kLinearGemvMaxRows, with partial 16-row blocks.
        CheckLinear(640, 1152, K, cb, {1, 9, 30, 48}, K == 4, &ws, 0, 3);
        CheckLinear(640, 1152, K, cb, {49, 64, 100}, false, &ws);
        // The fused GEMM where the rule dequantises and calls cuBLAS (UseDequantGemm).
        CheckLinear(256, 384, K, cb, {1024}, K == 6, &ws, 0, 3);
      }
    // Layers of one input, together (same K) and one by one (mixed K), at GEMV and GEMM sizes.
    for (Codebook cb : cbs) CheckLinearShared(256, {512, 128, 128}, {4, 4, 4}, cb, {1, 2, 8, 16, 17, 300}, &ws);
    CheckLinearShared(384, {256, 128}, {2, 3}, Codebook::kMcg, {1, 8}, &ws);
    // Four layers of unequal widths in one DenseGemvKernel launch (each block picks its layer).
    for (int K : {2, 8}) CheckLinearShared(384, {128, 384, 256, 128}, {K, K, K, K}, Codebook::k3Inst, {1, 3, 9}, &ws);
    if (big) {
      CheckLinearShared(4096, {12288, 1024, 1024}, {4, 4, 4}, Codebook::kMcg, {1, 8, 16, 32}, &ws);
      for (int K : {2, 3, 4}) {
        CheckLinear(4096, 14336, K, Codebook::kMcg, {1, 8}, false, &ws);
        CheckLinear(14336, 4096, K, K == 3 ? Codebook::kMul1 : Codebook::kMcg, {1, 3}, false, &ws);
      }
      CheckLinear(2048, 4096, 2, Codebook::k3Inst, {1, 256}, true, &ws);
      CheckLinear(5120, 2304, 2, Codebook::kMcg, {1, 4}, false, &ws);
      // The small decode shapes of the one-launch GEMV, and forced k-slices (uneven, across
      // 128-blocks, the longest) at a partial last column block.
      for (int K : {2, 3, 4}) {
        CheckLinear(4096, 2048, K, Codebook::kMcg, {1, 2, 5, 8}, false, &ws);
        CheckLinear(2048, 4096, K, K == 4 ? Codebook::kMul1 : Codebook::kMcg, {1, 8}, K == 3, &ws);
        CheckLinear(5120, 2304, K, K == 3 ? Codebook::k3Inst : Codebook::kMcg, {1, 8, 40}, false, &ws);
      }
      for (int slice : {1, 3, 7, 13, 24}) CheckLinear(5120, 2304, 2, Codebook::kMcg, {1, 6, 48}, true, &ws, slice);
      // Shapes where the path rule (PlanDenseGemv, kernels/cuda/gemv_plan.cu) takes either path by m,
      // and the one-launch kernel forced where the rule takes the three launches.
      CheckLinear(4096, 4096, 2, Codebook::kMcg, {1, 2, 8, 32}, true, &ws);
      CheckLinear(5120, 5120, 3, Codebook::kMcg, {1, 2, 8, 32}, false, &ws);
      CheckLinear(4096, 14336, 2, Codebook::kMcg, {2, 8}, false, &ws, 0, 1);
      CheckLinear(14336, 4096, 4, Codebook::kMul1, {8}, true, &ws, 0, 1);
      // The GLM-4.5-Air attention projections at decode batches: the k-sliced GEMM, forced and chosen.
      CheckLinear(4096, 12288, 4, Codebook::kMcg, {16, 33}, true, &ws, 0, 3);
      CheckLinear(4096, 12288, 4, Codebook::kMcg, {64}, true, &ws);
      CheckLinear(12288, 4096, 4, Codebook::kMcg, {64}, false, &ws);
    }
    MoeCase mixed{"mixed-K/cb+bias+limit", 256, 384, 16, 4, 4, 256, {2, Codebook::kMcg}, {3, Codebook::k3Inst},
                  {4, Codebook::kMul1}, {5, Codebook::kMcg}, {2, Codebook::kMul1}, {3, Codebook::kMcg}, 0.75f, true,
                  false};
    CheckMoe(mixed, {1, 2, 3, 7, 8, 17, 64, 256}, true, true);
    CheckMoe(mixed, {1, 8, 70}, false, false, /*registered=*/true);
    CheckMoe(mixed, {1, 8, 70}, false, false, /*registered=*/true, /*misaligned=*/true);
    MoeCase qwen{"qwen-like (shared gate, no limit)", 512, 128, 32, 0, 10, 256, {3, Codebook::kMul1},
                 {3, Codebook::kMul1}, {3, Codebook::kMul1}, {4, Codebook::k3Inst}, {4, Codebook::k3Inst},
                 {4, Codebook::k3Inst}, 0.0f, false, true};
    CheckMoe(qwen, {1, 8, 64, 100}, false, false);
    if (big) {
      MoeCase glm{"glm-like 2048/1024 E64 top8 K2 mcg", 2048, 1024, 64, 0, 8, 1024, {2, Codebook::kMcg},
                  {2, Codebook::kMcg}, {2, Codebook::kMcg}, {2, Codebook::kMcg}, {2, Codebook::kMcg},
                  {2, Codebook::kMcg}, 10.0f, false, false};
      CheckMoe(glm, {1, 8, 64}, true, true);
    }
    CheckMixedExperts(false, big);
    CheckCooperativeMoe(false);
  }
  std::printf("\nworst ‖out−ref‖/‖ref‖ per kernel (%d cases, %d failures):\n", g_cases, g_failures);
  for (const auto& [k, v] : g_worst) std::printf("  %-22s %.3e%s\n", k.c_str(), v, k == "dequant-mismatches" ? " (count)" : "");
  return g_failures ? 1 : 0;
}

}  // namespace
}  // namespace exl3

int main(int argc, char** argv) { return exl3::Main(argc, argv); }
