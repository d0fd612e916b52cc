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

std::atomic<int> g_max_isa{static_cast<int>(Isa::kAvx512Vbmi)};

Isa CurrentIsa() {
  const int max = g_max_isa.load(std::memory_order_relaxed);
  if (max >= static_cast<int>(Isa::kAvx512Vbmi) && Avx512VbmiSupported()) return Isa::kAvx512Vbmi;
  if (max >= static_cast<int>(Isa::kAvx512) && Avx512Supported()) return Isa::kAvx512;
  if (max >= static_cast<int>(Isa::kAvx2) && Avx2Supported()) return Isa::kAvx2;
  return Isa::kScalar;
}

// Column tiles per work item: wide strips read the trellis in long contiguous runs (one tile row
// of a strip is contiguous), but there must be enough items to keep every thread busy. The
// one-token kernels and the AVX2 multi-token kernel keep T * strip * 256 B of accumulators, so
// wide strips are for few tokens. The AVX-512 multi-token kernel decodes chunks of at most
// kAvx512BufferTiles tiles (strip width x rows): strips of kAvx512BufferTiles / (k / 16) tiles
// make short layers (k < 256) one chunk, whose accumulators never leave the registers.
int StripTiles(int n_tiles, int k_tiles, int threads, int jobs, int tokens, Isa isa) {
  const int want_items = std::max(1, (threads * 2 + jobs - 1) / std::max(1, jobs));
  const int by_threads = std::max(1, n_tiles / want_items);
  int by_size = std::max(1, 64 / std::max(1, tokens));
  if ((isa == Isa::kAvx512 || isa == Isa::kAvx512Vbmi) && tokens > 1) {
    by_size = std::max(1, kAvx512BufferTiles / std::max(1, k_tiles));
  }
  return std::clamp(std::min(by_size, by_threads), 1, 64);
}

// Grows a scratch buffer (kept between calls, so the hot path neither allocates nor zero-fills
// once warm; Scratch::ReleaseLarge gives back what one long call grew past kKeepScratchBytes,
// base/scratch.h) and returns its data.
float* Grow(std::vector<float>& v, size_t floats) {
  if (v.size() < floats) v.resize(floats);
  return v.data();
}

// One projection of the MoE: input rows [T, k] -> output [T, n], with its scratch. The vectors
// are reused from call to call; their sizes are capacities, T and the layer give the used part.
struct ProjWork {
  const Exl3LinearView* w = nullptr;
  const float* in = nullptr;  // [T, k]
  int T = 0;
  float* out = nullptr;       // [T, n]: out_buf, or the caller's output
  std::vector<float> xt, xp;  // transformed input, and the SIMD lane layout of it
  std::vector<float> out_buf;
};

// Input transform (and SIMD layout) of p.in, and p.out pointed at its scratch unless set.
void PrepareInput(ProjWork& p, Isa isa) {
  const int k = p.w->in_features;
  float* xt = Grow(p.xt, static_cast<size_t>(p.T) * k);
  ApplyInputTransform(*p.w, p.in, p.T, xt);
  if (isa != Isa::kScalar) Avx2PrepareX(xt, p.T, k, Grow(p.xp, Avx2PreparedFloats(p.T, k)));
  if (p.out == nullptr) p.out = Grow(p.out_buf, static_cast<size_t>(p.T) * p.w->out_features);
}

void RunStrip(ProjWork& p, Isa isa, int j0, int j1) {
  switch (isa) {
    case Isa::kAvx512Vbmi: InnerProductAvx512Vbmi(*p.w, p.xp.data(), p.T, j0, j1, p.out); break;
    case Isa::kAvx512: InnerProductAvx512(*p.w, p.xp.data(), p.T, j0, j1, p.out); break;
    case Isa::kAvx2: InnerProductAvx2(*p.w, p.xp.data(), p.T, j0, j1, p.out); break;
    case Isa::kScalar: InnerProductScalar(*p.w, p.xt.data(), p.T, j0, j1, p.out); break;
  }
}

// Work items over strips of several projections at once.
struct StripItem {
  ProjWork* p;
  int j0, j1;
};

void MakeStrips(const std::vector<ProjWork*>& projs, int threads, Isa isa,
                std::vector<StripItem>* items) {
  items->clear();
  for (ProjWork* p : projs) {
    if (p->T == 0) continue;
    const int n_tiles = p->w->out_features / 16;
    const int s = StripTiles(n_tiles, p->w->in_features / 16, threads,
                             static_cast<int>(projs.size()), p->T, isa);
    for (int j = 0; j < n_tiles; j += s) items->push_back({p, j, std::min(n_tiles, j + s)});
  }
}

// One routed expert used by the batch (or the shared expert): its rows and projections.
struct MoeJob {
  const ExpertMlp* mlp = nullptr;
  float limit = 0.0f;
  std::vector<int> tokens;  // row -> token
  std::vector<float> xin;   // [rows, H] gathered hidden states
  ProjWork gate, up, down;
};

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

bool Avx512VbmiSupported() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512bw") && Avx512Supported();
  return ok;
#else
  return false;
#endif
}

std::string_view ActiveIsa() {
  switch (CurrentIsa()) {
    case Isa::kAvx512Vbmi: return "avx512vbmi";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: break;
  }
  return "scalar";
}

Isa SetMaxIsa(Isa max) { return static_cast<Isa>(g_max_isa.exchange(static_cast<int>(max))); }

bool ForceScalar(bool force) {
  return SetMaxIsa(force ? Isa::kScalar : Isa::kAvx512Vbmi) == Isa::kScalar;
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

// Everything a call needs besides the weights and the caller's buffers, kept between calls.
struct CpuBackend::Scratch {
  ProjWork linear;
  std::vector<MoeJob> jobs;  // the first num_jobs are this call's
  std::vector<int> job_of_expert, pair_job, pair_row;
  std::vector<ProjWork*> projs;
  std::vector<StripItem> items;

  // After a call: buffers a long prefill grew past kKeepScratchBytes go back to the allocator,
  // and all of them when together they hold more than kKeepScratchTotalBytes (a prefill over
  // many experts grows one set of mid-sized buffers per expert: hundreds of MB in all).
  void ReleaseLarge() {
    size_t total = 0;
    ForEach([&](auto& v) { total += ScratchBytes(v); });
    if (total > kKeepScratchTotalBytes) {
      ForEach([](auto& v) { ReleaseScratch(v); });
    } else {
      ForEach([](auto& v) { ReleaseScratchIfLarge(v); });
    }
  }

  // fn(vector&) for every buffer that grows with the tokens of a call.
  template <class Fn>
  void ForEach(Fn fn) {
    auto proj = [&](ProjWork& p) {
      fn(p.xt);
      fn(p.xp);
      fn(p.out_buf);
    };
    proj(linear);
    for (MoeJob& job : jobs) {
      fn(job.tokens);
      fn(job.xin);
      for (ProjWork* p : {&job.gate, &job.up, &job.down}) proj(*p);
    }
    fn(pair_job);
    fn(pair_row);
  }
};

CpuBackend::CpuBackend(int num_threads)
    : pool_(std::make_unique<ThreadPool>(num_threads)), scratch_(std::make_unique<Scratch>()) {}
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
  Scratch& sc = *scratch_;
  ProjWork& p = sc.linear;
  p.w = &w;
  p.in = x;
  p.T = num_tokens;
  p.out = y;  // the strips write y directly (the input was copied into p.xt first)
  PrepareInput(p, isa);
  sc.projs.assign(1, &p);
  MakeStrips(sc.projs, pool_->size(), isa, &sc.items);
  pool_->ParallelFor(static_cast<int>(sc.items.size()), [&](int i, int) {
    RunStrip(*sc.items[i].p, isa, sc.items[i].j0, sc.items[i].j1);
  });
  ApplyOutputTransform(w, y, num_tokens);
  sc.ReleaseLarge();
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
  Scratch& sc = *scratch_;

  // Jobs: one per routed expert used (every pair is its own row), plus the shared expert.
  int num_jobs = 0;
  auto new_job = [&](const ExpertMlp* mlp, float limit) -> int {
    if (num_jobs == static_cast<int>(sc.jobs.size())) sc.jobs.emplace_back();
    MoeJob& job = sc.jobs[num_jobs];
    job.mlp = mlp;
    job.limit = limit;
    job.tokens.clear();
    for (ProjWork* p : {&job.gate, &job.up, &job.down}) {
      p->T = 0;
      p->out = nullptr;
    }
    return num_jobs++;
  };
  sc.job_of_expert.assign(layer.num_experts(), -1);
  const int base = a.begin(0);
  const int num_pairs = a.end(T - 1) - base;
  sc.pair_job.resize(std::max(0, num_pairs));
  sc.pair_row.resize(std::max(0, num_pairs));
  for (int t = 0; t < T; ++t) {
    for (int i = a.begin(t); i < a.end(t); ++i) {
      const int e = a.expert_ids[i];
      if (sc.job_of_expert[e] < 0) sc.job_of_expert[e] = new_job(layer.experts[e], layer.swiglu_limit);
      MoeJob& job = sc.jobs[sc.job_of_expert[e]];
      sc.pair_job[i - base] = sc.job_of_expert[e];
      sc.pair_row[i - base] = static_cast<int>(job.tokens.size());
      job.tokens.push_back(t);
    }
  }
  int shared_job = -1;
  if (include_shared && layer.shared != nullptr) {
    shared_job = new_job(layer.shared, layer.shared_swiglu_limit);
    for (int t = 0; t < T; ++t) sc.jobs[shared_job].tokens.push_back(t);
  }
  const int J = num_jobs;
  std::vector<MoeJob>& jobs = sc.jobs;
  const int threads = pool_->size();

  // 1: gather rows (the shared expert reads x itself), input transforms of gate and up.
  pool_->ParallelFor(J, [&](int j, int) {
    if (j == shared_job) return;
    MoeJob& job = jobs[j];
    const int rows = static_cast<int>(job.tokens.size());
    float* xin = Grow(job.xin, static_cast<size_t>(rows) * H);
    for (int r = 0; r < rows; ++r) {
      std::memcpy(xin + static_cast<size_t>(r) * H, x + static_cast<size_t>(job.tokens[r]) * H,
                  H * sizeof(float));
    }
  });
  pool_->ParallelFor(2 * J, [&](int item, int) {
    MoeJob& job = jobs[item / 2];
    ProjWork& p = item % 2 == 0 ? job.gate : job.up;
    p.w = item % 2 == 0 ? &job.mlp->gate : &job.mlp->up;
    p.in = item / 2 == shared_job ? x : job.xin.data();
    p.T = static_cast<int>(job.tokens.size());
    PrepareInput(p, isa);
  });
  // 2: gate and up middle products.
  sc.projs.clear();
  for (int j = 0; j < J; ++j) {
    sc.projs.push_back(&jobs[j].gate);
    sc.projs.push_back(&jobs[j].up);
  }
  MakeStrips(sc.projs, threads, isa, &sc.items);
  pool_->ParallelFor(static_cast<int>(sc.items.size()), [&](int i, int) {
    RunStrip(*sc.items[i].p, isa, sc.items[i].j0, sc.items[i].j1);
  });
  // 3: output transforms, SwiGLU, down's input transform.
  pool_->ParallelFor(J, [&](int j, int) {
    MoeJob& job = jobs[j];
    ApplyOutputTransform(*job.gate.w, job.gate.out, job.gate.T);
    ApplyOutputTransform(*job.up.w, job.up.out, job.up.T);
    SwiGlu(job.gate.out, job.up.out, static_cast<size_t>(job.gate.T) * job.gate.w->out_features,
           job.limit);
    job.down.w = &job.mlp->down;
    job.down.in = job.gate.out;
    job.down.T = job.gate.T;
    PrepareInput(job.down, isa);
  });
  // 4: down middle products.
  sc.projs.clear();
  for (int j = 0; j < J; ++j) sc.projs.push_back(&jobs[j].down);
  MakeStrips(sc.projs, threads, isa, &sc.items);
  pool_->ParallelFor(static_cast<int>(sc.items.size()), [&](int i, int) {
    RunStrip(*sc.items[i].p, isa, sc.items[i].j0, sc.items[i].j1);
  });
  // 5: down's output transform.
  pool_->ParallelFor(J, [&](int j, int) {
    ApplyOutputTransform(*jobs[j].down.w, jobs[j].down.out, jobs[j].down.T);
  });
  // 6: weighted sum per token, pairs in the order given, then the shared expert.
  pool_->ParallelFor(T, [&](int t, int) {
    float* yt = y + static_cast<size_t>(t) * H;
    std::fill(yt, yt + H, 0.0f);
    for (int i = a.begin(t); i < a.end(t); ++i) {
      const MoeJob& job = jobs[sc.pair_job[i - base]];
      const float* d = job.down.out + static_cast<size_t>(sc.pair_row[i - base]) * H;
      const float wgt = a.weights[i];
      for (int h = 0; h < H; ++h) yt[h] += wgt * d[h];
    }
    if (shared_job >= 0) {
      const float* d = jobs[shared_job].down.out + static_cast<size_t>(t) * H;
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
  sc.ReleaseLarge();
  return absl::OkStatus();
}

}  // namespace exl3::cpu
