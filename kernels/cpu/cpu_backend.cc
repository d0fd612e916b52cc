#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/inner_product.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_tile.h"

namespace exl3::cpu {
namespace {

std::atomic<int> g_max_isa{static_cast<int>(Isa::kAvx512)};

Isa CurrentIsa() {
  const int max = g_max_isa.load(std::memory_order_relaxed);
  if (max >= static_cast<int>(Isa::kAvx512) && Avx512Supported()) return Isa::kAvx512;
  if (max >= static_cast<int>(Isa::kAvx2) && Avx2Supported()) return Isa::kAvx2;
  return Isa::kScalar;
}

// Column tiles per work item: wide strips read the trellis in long contiguous runs (one tile row
// of a strip is contiguous), but there must be enough items to keep every thread busy; the
// kernels keep T * strip * 256 B of accumulators, so wide strips are for few tokens.
int StripTiles(int n_tiles, int threads, int jobs, int tokens) {
  const int by_acc = std::max(1, 64 / std::max(1, tokens));
  const int want_items = std::max(1, (threads * 2 + jobs - 1) / std::max(1, jobs));
  const int by_threads = std::max(1, n_tiles / want_items);
  return std::clamp(std::min(by_acc, by_threads), 1, 64);
}

// One projection of the MoE: input rows [T, k] -> output [T, n], with its scratch.
struct ProjWork {
  const Exl3LinearView* w = nullptr;
  const float* in = nullptr;  // [T, k]
  int T = 0;
  std::vector<float> xt, xp;  // transformed input, and the AVX2 lane layout of it
  std::vector<float> out;     // [T, n]
};

void PrepareInput(ProjWork& p, Isa isa) {
  const bool avx2 = isa != Isa::kScalar;
  const int k = p.w->in_features;
  p.xt.resize(static_cast<size_t>(p.T) * k);
  ApplyInputTransform(*p.w, p.in, p.T, p.xt.data());
  if (avx2) {
    p.xp.resize(Avx2PreparedFloats(p.T, k));
    Avx2PrepareX(p.xt.data(), p.T, k, p.xp.data());
  }
  p.out.resize(static_cast<size_t>(p.T) * p.w->out_features);
}

void RunStrip(ProjWork& p, Isa isa, int j0, int j1) {
  switch (isa) {
    case Isa::kAvx512: InnerProductAvx512(*p.w, p.xp.data(), p.T, j0, j1, p.out.data()); break;
    case Isa::kAvx2: InnerProductAvx2(*p.w, p.xp.data(), p.T, j0, j1, p.out.data()); break;
    case Isa::kScalar: InnerProductScalar(*p.w, p.xt.data(), p.T, j0, j1, p.out.data()); break;
  }
}

// Work items over strips of several projections at once.
struct StripItem {
  ProjWork* p;
  int j0, j1;
};

std::vector<StripItem> MakeStrips(const std::vector<ProjWork*>& projs, int threads) {
  std::vector<StripItem> items;
  for (ProjWork* p : projs) {
    if (p->T == 0) continue;
    const int n_tiles = p->w->out_features / 16;
    const int s = StripTiles(n_tiles, threads, static_cast<int>(projs.size()), p->T);
    for (int j = 0; j < n_tiles; j += s) items.push_back({p, j, std::min(n_tiles, j + s)});
  }
  return items;
}

}  // namespace

bool Avx2Supported() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

bool Avx512Supported() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512f") && Avx2Supported();
  return ok;
#else
  return false;
#endif
}

std::string_view ActiveIsa() {
  switch (CurrentIsa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: break;
  }
  return "scalar";
}

Isa SetMaxIsa(Isa max) { return static_cast<Isa>(g_max_isa.exchange(static_cast<int>(max))); }

bool ForceScalar(bool force) {
  return SetMaxIsa(force ? Isa::kScalar : Isa::kAvx512) == Isa::kScalar;
}

void InnerProductScalar(const Exl3LinearView& w, const float* xt, int num_tokens, int j0, int j1,
                        float* y) {
  const int k = w.in_features, n = w.out_features;
  const float* table = CodebookTable(w.codebook);
  float tile[kTileElems];
  std::vector<float> acc(static_cast<size_t>(num_tokens) * 16);
  for (int j = j0; j < j1; ++j) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int i = 0; i < k / 16; ++i) {
      DecodeTileFloat(w.tile(i, j), w.bits, table, tile);
      for (int t = 0; t < num_tokens; ++t) {
        const float* xr = xt + static_cast<size_t>(t) * k + 16 * i;
        float* a = acc.data() + 16 * t;
        for (int r = 0; r < 16; ++r) {
          const float xv = xr[r];
          for (int c = 0; c < 16; ++c) a[c] += xv * tile[r * 16 + c];
        }
      }
    }
    for (int t = 0; t < num_tokens; ++t) {
      std::memcpy(y + static_cast<size_t>(t) * n + 16 * j, acc.data() + 16 * t, 16 * sizeof(float));
    }
  }
}

CpuBackend::CpuBackend(int num_threads) : pool_(std::make_unique<ThreadPool>(num_threads)) {}
CpuBackend::~CpuBackend() = default;

int CpuBackend::num_threads() const { return pool_->size(); }

absl::Status CpuBackend::Linear(const Exl3LinearView& w, const float* x, int num_tokens,
                                float* y) {
  absl::Status s = ValidateLinear(w);
  if (!s.ok()) return s;
  if (num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  if (num_tokens == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  const Isa isa = CurrentIsa();
  ProjWork p;
  p.w = &w;
  p.in = x;
  p.T = num_tokens;
  PrepareInput(p, isa);
  std::vector<ProjWork*> projs = {&p};
  std::vector<StripItem> items = MakeStrips(projs, pool_->size());
  pool_->ParallelFor(static_cast<int>(items.size()), [&](int i, int) {
    RunStrip(*items[i].p, isa, items[i].j0, items[i].j1);
  });
  ApplyOutputTransform(w, p.out.data(), num_tokens);
  std::memcpy(y, p.out.data(), p.out.size() * sizeof(float));
  return absl::OkStatus();
}

absl::Status CpuBackend::Moe(const MoeLayerView& layer, const float* x, const MoeAssignments& a,
                             bool include_shared, float* y) {
  absl::Status s = ValidateMoeLayer(layer);
  if (!s.ok()) return s;
  s = ValidateAssignments(layer, a);
  if (!s.ok()) return s;
  const int T = a.num_tokens, H = layer.hidden_size;
  if (T == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  const Isa isa = CurrentIsa();

  // Jobs: one per routed expert used (every pair is its own row), plus the shared expert.
  struct Job {
    const ExpertMlp* mlp;
    float limit;
    std::vector<int> tokens;  // row -> token
    std::vector<float> xin;   // [rows, H] gathered hidden states
    ProjWork gate, up, down;
  };
  std::vector<Job> jobs;
  std::vector<int> job_of_expert(layer.num_experts(), -1);
  const int num_pairs = T > 0 ? a.end(T - 1) - a.begin(0) : 0;
  std::vector<int> pair_job(std::max(0, num_pairs)), pair_row(std::max(0, num_pairs));
  const int base = a.begin(0);
  jobs.reserve(layer.num_experts() + 1);
  for (int t = 0; t < T; ++t) {
    for (int i = a.begin(t); i < a.end(t); ++i) {
      const int e = a.expert_ids[i];
      if (job_of_expert[e] < 0) {
        job_of_expert[e] = static_cast<int>(jobs.size());
        jobs.push_back(Job{layer.experts[e], layer.swiglu_limit, {}, {}, {}, {}, {}});
      }
      Job& job = jobs[job_of_expert[e]];
      pair_job[i - base] = job_of_expert[e];
      pair_row[i - base] = static_cast<int>(job.tokens.size());
      job.tokens.push_back(t);
    }
  }
  int shared_job = -1;
  if (include_shared && layer.shared != nullptr) {
    shared_job = static_cast<int>(jobs.size());
    jobs.push_back(Job{layer.shared, layer.shared_swiglu_limit, {}, {}, {}, {}, {}});
    for (int t = 0; t < T; ++t) jobs.back().tokens.push_back(t);
  }
  const int J = static_cast<int>(jobs.size());
  const int threads = pool_->size();

  // 1: gather rows, input transforms of gate and up.
  pool_->ParallelFor(2 * J, [&](int item, int) {
    Job& job = jobs[item / 2];
    const int rows = static_cast<int>(job.tokens.size());
    if (item % 2 == 0) {
      job.xin.resize(static_cast<size_t>(rows) * H);
      for (int r = 0; r < rows; ++r) {
        std::memcpy(job.xin.data() + static_cast<size_t>(r) * H,
                    x + static_cast<size_t>(job.tokens[r]) * H, H * sizeof(float));
      }
    }
  });
  pool_->ParallelFor(2 * J, [&](int item, int) {
    Job& job = jobs[item / 2];
    ProjWork& p = item % 2 == 0 ? job.gate : job.up;
    p.w = item % 2 == 0 ? &job.mlp->gate : &job.mlp->up;
    p.in = job.xin.data();
    p.T = static_cast<int>(job.tokens.size());
    PrepareInput(p, isa);
  });
  // 2: gate and up middle products.
  std::vector<ProjWork*> projs;
  for (Job& job : jobs) {
    projs.push_back(&job.gate);
    projs.push_back(&job.up);
  }
  std::vector<StripItem> items = MakeStrips(projs, threads);
  pool_->ParallelFor(static_cast<int>(items.size()), [&](int i, int) {
    RunStrip(*items[i].p, isa, items[i].j0, items[i].j1);
  });
  // 3: output transforms, SwiGLU, down's input transform.
  pool_->ParallelFor(J, [&](int j, int) {
    Job& job = jobs[j];
    ApplyOutputTransform(*job.gate.w, job.gate.out.data(), job.gate.T);
    ApplyOutputTransform(*job.up.w, job.up.out.data(), job.up.T);
    SwiGlu(job.gate.out.data(), job.up.out.data(), job.gate.out.size(), job.limit);
    job.down.w = &job.mlp->down;
    job.down.in = job.gate.out.data();
    job.down.T = job.gate.T;
    PrepareInput(job.down, isa);
  });
  // 4: down middle products.
  projs.clear();
  for (Job& job : jobs) projs.push_back(&job.down);
  items = MakeStrips(projs, threads);
  pool_->ParallelFor(static_cast<int>(items.size()), [&](int i, int) {
    RunStrip(*items[i].p, isa, items[i].j0, items[i].j1);
  });
  // 5: down's output transform.
  pool_->ParallelFor(J, [&](int j, int) {
    ApplyOutputTransform(*jobs[j].down.w, jobs[j].down.out.data(), jobs[j].down.T);
  });
  // 6: weighted sum per token, pairs in the order given, then the shared expert.
  pool_->ParallelFor(T, [&](int t, int) {
    float* yt = y + static_cast<size_t>(t) * H;
    std::fill(yt, yt + H, 0.0f);
    for (int i = a.begin(t); i < a.end(t); ++i) {
      const Job& job = jobs[pair_job[i - base]];
      const float* d = job.down.out.data() + static_cast<size_t>(pair_row[i - base]) * H;
      const float wgt = a.weights[i];
      for (int h = 0; h < H; ++h) yt[h] += wgt * d[h];
    }
    if (shared_job >= 0) {
      const float* d = jobs[shared_job].down.out.data() + static_cast<size_t>(t) * H;
      float wgt = 1.0f;
      if (layer.shared_gate != nullptr) {
        const float* xt = x + static_cast<size_t>(t) * H;
        double acc = 0.0;
        for (int h = 0; h < H; ++h) acc += static_cast<double>(xt[h]) * layer.shared_gate[h];
        wgt = 1.0f / (1.0f + std::exp(-static_cast<float>(acc)));
      }
      for (int h = 0; h < H; ++h) yt[h] += wgt * d[h];
    }
  });
  return absl::OkStatus();
}

}  // namespace exl3::cpu
