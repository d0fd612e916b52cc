// exl3-cpu-bench: speed of the CPU backend against this machine's memory-read bandwidth.
//
// Measures, in one run: (1) a plain multithreaded memory read (AVX2 loads summed) over a buffer
// far larger than the caches, (2) EXL3 GEMV (T tokens) over a set of distinct layers larger than the
// caches, per K and codebook, (3) one MoE layer (top-k routed experts + shared) at T tokens.
// Reports weights/s, weights/s per thread, trellis GB/s and its fraction of the read bandwidth.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/command_line.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/fp16.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: exl3-cpu-bench [--threads 1,N] [--k 4096] [--n 14336] [--bits 2,3,4]\n"
    "                      [--codebooks 3inst,mcg,mul1] [--tokens 1] [--seconds 1]\n"
    "                      [--moe-hidden 4096] [--moe-inter 2048] [--moe-experts 32] [--moe-topk 8]\n"
    "                      [--mem-mib 1024] [--isa best|avx512vbmi|avx512|avx2|scalar]\n"
    "\n"
    "Prints the memory-read bandwidth, then EXL3 linear (GEMV) and MoE throughput of the CPU\n"
    "backend (ISA chosen at run time) per thread count.\n";

struct Flags {
  std::vector<int> threads;
  int k = 4096, n = 14336, tokens = 1;
  std::vector<int> bits = {2, 3, 4};
  std::vector<std::string> codebooks = {"3inst", "mcg", "mul1"};
  double seconds = 1.0;
  int moe_hidden = 4096, moe_inter = 2048, moe_experts = 32, moe_topk = 8;
  int mem_mib = 1024;
  std::string isa = "best";
};

bool ParseInts(const std::string& s, std::vector<int>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int v;
    if (!absl::SimpleAtoi(p, &v) || v <= 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "exl3-cpu-bench: %s needs a value (see --help)\n", a.c_str());
      return false;
    }
    std::string v = argv[++i];
    std::vector<int> one;
    bool ok = true;
    auto single = [&](int* dst) {
      ok = ParseInts(v, &one) && one.size() == 1;
      if (ok) *dst = one[0];
    };
    if (a == "--threads") ok = ParseInts(v, &f->threads);
    else if (a == "--k") single(&f->k);
    else if (a == "--n") single(&f->n);
    else if (a == "--tokens") single(&f->tokens);
    else if (a == "--bits") ok = ParseInts(v, &f->bits);
    else if (a == "--codebooks") f->codebooks = absl::StrSplit(v, ',');
    else if (a == "--seconds") ok = absl::SimpleAtod(v, &f->seconds) && f->seconds > 0;
    else if (a == "--moe-hidden") single(&f->moe_hidden);
    else if (a == "--moe-inter") single(&f->moe_inter);
    else if (a == "--moe-experts") single(&f->moe_experts);
    else if (a == "--moe-topk") single(&f->moe_topk);
    else if (a == "--mem-mib") single(&f->mem_mib);
    else if (a == "--isa") {
      f->isa = v;
      ok = v == "best" || v == "avx512vbmi" || v == "avx512" || v == "avx2" || v == "scalar";
    }
    else {
      std::fprintf(stderr, "exl3-cpu-bench: unknown flag %s (see --help)\n", a.c_str());
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "exl3-cpu-bench: bad value '%s' for %s\n", v.c_str(), a.c_str());
      return false;
    }
  }
  if (f->k % 128 || f->n % 128 || f->moe_hidden % 128 || f->moe_inter % 128) {
    std::fprintf(stderr, "exl3-cpu-bench: shapes must be multiples of 128\n");
    return false;
  }
  for (int b : f->bits) {
    if (b < 1 || b > 8) {
      std::fprintf(stderr, "exl3-cpu-bench: --bits must be in 1..8\n");
      return false;
    }
  }
  for (const auto& c : f->codebooks) {
    exl3::Codebook cb;
    if (!exl3::ParseCodebook(c, &cb)) {
      std::fprintf(stderr, "exl3-cpu-bench: unknown codebook '%s'\n", c.c_str());
      return false;
    }
  }
  if (f->moe_topk > f->moe_experts) {
    std::fprintf(stderr, "exl3-cpu-bench: --moe-topk exceeds --moe-experts\n");
    return false;
  }
  return true;
}

// A layer with random trellis bits and +-1/sqrt(k) scales, owning its memory.
struct Layer {
  std::vector<uint16_t> trellis, suh, svh;
  exl3::Exl3LinearView view;
  Layer(int k, int n, int K, exl3::Codebook cb, std::mt19937& rng) {
    view.in_features = k;
    view.out_features = n;
    view.bits = K;
    view.codebook = cb;
    trellis.resize(view.trellis_words());
    uint64_t z = rng();
    for (size_t i = 0; i + 4 <= trellis.size(); i += 4) {  // splitmix64: fast random bits
      z += 0x9E3779B97F4A7C15ull;
      uint64_t v = z;
      v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
      v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
      v ^= v >> 31;
      std::memcpy(&trellis[i], &v, 8);
    }
    const float s = 1.0f / std::sqrt(static_cast<float>(k));
    for (int i = 0; i < k; ++i) suh.push_back(exl3::FloatToHalfBits(rng() & 1 ? -s : s));
    for (int i = 0; i < n; ++i) svh.push_back(exl3::FloatToHalfBits(rng() & 1 ? -1.f : 1.f));
    view.trellis = trellis.data();
    view.suh = suh.data();
    view.svh = svh.data();
  }
  size_t bytes() const { return trellis.size() * 2; }
};

double CpuSeconds() {  // all threads of this process
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Bandwidth {
  double wall_gbs = 0;     // best pass, wall clock
  double per_cpu_gbs = 0;  // bytes per CPU-second: what one core reads when it runs
};

// Plain read bandwidth: every thread sums its slice with 64-bit loads, repeated.
Bandwidth ReadBandwidth(exl3::cpu::ThreadPool& pool, const std::vector<uint64_t>& buf,
                        double seconds) {
  const int T = pool.size();
  const size_t per = buf.size() / T;
  std::vector<uint64_t> sinks(T * 8);
  size_t bytes = 0;
  double best = 0, total_bytes = 0;
  const double cpu0 = CpuSeconds();
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  do {
    const auto t0 = Clock::now();
    pool.ParallelFor(T, [&](int i, int) {
      const uint64_t* p = buf.data() + i * per;
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (size_t j = 0; j + 4 <= per; j += 4) {
        a0 += p[j];
        a1 ^= p[j + 1];
        a2 += p[j + 2];
        a3 ^= p[j + 3];
      }
      sinks[i * 8] = a0 + a1 + a2 + a3;
    });
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    bytes = per * T * 8;
    best = std::max(best, bytes / dt / 1e9);
    total_bytes += bytes;
  } while (Clock::now() < end);
  const double cpu = CpuSeconds() - cpu0;
  volatile uint64_t s = 0;
  for (uint64_t v : sinks) s = s + v;
  return {best, total_bytes / cpu / 1e9};
}

struct Timing {
  double wall = 0;  // median wall seconds per call
  double cpu = 0;   // mean CPU seconds (all threads) per call
};

template <typename Fn>
Timing TimeIt(double seconds, Fn fn) {
  fn();  // warm-up
  std::vector<double> times;
  const double cpu0 = CpuSeconds();
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  do {
    const auto t0 = Clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  } while (Clock::now() < end || times.size() < 3);
  const double cpu = (CpuSeconds() - cpu0) / times.size();
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], cpu};
}

}  // namespace

int main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-cpu-bench")) return 0;
  Flags f;
  if (!ParseFlags(argc, argv, &f)) return 2;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (f.isa == "avx512") exl3::cpu::SetMaxIsa(exl3::cpu::Isa::kAvx512);
  if (f.isa == "avx2") exl3::cpu::SetMaxIsa(exl3::cpu::Isa::kAvx2);
  if (f.isa == "scalar") exl3::cpu::SetMaxIsa(exl3::cpu::Isa::kScalar);
  if (f.threads.empty()) f.threads = hw > 1 ? std::vector<int>{1, hw} : std::vector<int>{1};
  std::printf("exl3-cpu-bench: isa %s, %d hardware threads\n",
              std::string(exl3::cpu::ActiveIsa()).c_str(), hw);

  std::mt19937 rng(1234);
  std::vector<uint64_t> mem(static_cast<size_t>(f.mem_mib) << 17);
  for (size_t i = 0; i < mem.size(); ++i) mem[i] = i * 0x9E3779B97F4A7C15ull;

  // Memory-read bandwidth per thread count, measured first.
  std::vector<Bandwidth> bw(f.threads.size());
  std::vector<std::unique_ptr<exl3::cpu::CpuBackend>> backends;
  for (size_t ti = 0; ti < f.threads.size(); ++ti) {
    exl3::cpu::ThreadPool pool(f.threads[ti]);
    bw[ti] = ReadBandwidth(pool, mem, f.seconds);
    std::printf("memory read, %d threads: %.1f GB/s wall, %.1f GB per CPU-second\n", f.threads[ti],
                bw[ti].wall_gbs, bw[ti].per_cpu_gbs);
    backends.push_back(std::make_unique<exl3::cpu::CpuBackend>(f.threads[ti]));
  }
  mem.clear();
  mem.shrink_to_fit();

  // Linear: enough distinct layers that one pass exceeds the caches (about 128 MiB of trellis).
  std::printf("\n");
  for (int K : f.bits) {
    for (const auto& cbname : f.codebooks) {
      exl3::Codebook cb;
      exl3::ParseCodebook(cbname, &cb);
      const double layer_bytes = static_cast<double>(f.k) * f.n * K / 8;
      const int copies = std::clamp(static_cast<int>(128.0 * (1 << 20) / layer_bytes) + 1, 1, 16);
      std::vector<std::unique_ptr<Layer>> layers;
      for (int c = 0; c < copies; ++c) layers.push_back(std::make_unique<Layer>(f.k, f.n, K, cb, rng));
      std::vector<float> x(static_cast<size_t>(f.tokens) * f.k, 0.5f), y(static_cast<size_t>(f.tokens) * f.n);
      for (size_t ti = 0; ti < f.threads.size(); ++ti) {
        const int threads = f.threads[ti];
        exl3::cpu::CpuBackend& cpu = *backends[ti];
        size_t next = 0;
        const Timing t = TimeIt(f.seconds, [&] {
          (void)cpu.Linear(layers[next]->view, x.data(), f.tokens, y.data());
          next = (next + 1) % layers.size();
        });
        const double weights = static_cast<double>(f.k) * f.n * f.tokens;
        const double gbs = layers[0]->bytes() / t.wall / 1e9;
        const double per_cpu_gbs = layers[0]->bytes() / t.cpu / 1e9;
        std::printf("linear %dx%d K=%d %-5s T=%d threads %2d: %9.1f us wall  %6.2f G weights/s wall, "
                    "%5.2f G weights per CPU-s  %5.2f GB/s wall = %3.0f%% of read bw; per CPU-s %4.1f%% "
                    "(%zu layers cycled)\n",
                    f.k, f.n, K, cbname.c_str(), f.tokens, threads, t.wall * 1e6, weights / t.wall / 1e9,
                    weights / t.cpu / 1e9, gbs, 100 * gbs / bw[ti].wall_gbs,
                    100 * per_cpu_gbs / bw[ti].per_cpu_gbs, layers.size());
      }
    }
  }
  std::printf("\n");
  // MoE layer: hidden x inter experts (gate/up K=2 MCG, down K=3 MCG), top-k + shared, T tokens.
  const int H = f.moe_hidden, I = f.moe_inter, E = f.moe_experts;
  std::vector<std::unique_ptr<Layer>> owned;
  std::vector<exl3::ExpertMlp> mlps(E + 1);
  for (int e = 0; e <= E; ++e) {
    owned.push_back(std::make_unique<Layer>(H, I, 2, exl3::Codebook::kMcg, rng));
    owned.push_back(std::make_unique<Layer>(H, I, 2, exl3::Codebook::kMcg, rng));
    owned.push_back(std::make_unique<Layer>(I, H, 3, exl3::Codebook::kMcg, rng));
    mlps[e] = {owned[3 * e]->view, owned[3 * e + 1]->view, owned[3 * e + 2]->view};
  }
  exl3::MoeLayerView layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  for (int e = 0; e < E; ++e) layer.experts.push_back(&mlps[e]);
  layer.shared = &mlps[E];
  layer.shared_intermediate_size = I;
  for (size_t ti = 0; ti < f.threads.size(); ++ti) {
    const int threads = f.threads[ti];
    exl3::cpu::CpuBackend& cpu = *backends[ti];
    {
      std::vector<float> x(static_cast<size_t>(f.tokens) * H, 0.25f), y(x.size());
      std::vector<int32_t> ids(static_cast<size_t>(f.tokens) * f.moe_topk);
      std::vector<float> w(ids.size(), 1.0f / f.moe_topk);
      int round = 0;
      size_t bytes_per_call = 0;
      const Timing t = TimeIt(f.seconds, [&] {
        // Rotate the experts so consecutive calls read different weights.
        std::vector<bool> used(E, false);
        for (int tok = 0; tok < f.tokens; ++tok) {
          for (int j = 0; j < f.moe_topk; ++j) ids[tok * f.moe_topk + j] = (round * f.moe_topk + j + tok) % E;
        }
        bytes_per_call = owned[3 * E]->bytes() + owned[3 * E + 1]->bytes() + owned[3 * E + 2]->bytes();
        for (int32_t e : ids) {
          if (!used[e]) bytes_per_call += owned[3 * e]->bytes() + owned[3 * e + 1]->bytes() + owned[3 * e + 2]->bytes();
          used[e] = true;
        }
        ++round;
        (void)cpu.Moe(layer, x.data(), exl3::MoeAssignments::Fixed(f.tokens, f.moe_topk, ids.data(), w.data()),
                      true, y.data());
      });
      const double gbs = bytes_per_call / t.wall / 1e9;
      const double weights = 3.0 * H * I * (f.moe_topk + 1) * f.tokens;
      std::printf("moe H=%d I=%d top-%d+shared of %d experts, T=%d threads %2d: %9.1f us wall  "
                  "%5.2f G weights per CPU-s  %5.2f GB/s wall = %3.0f%% of read bw; per CPU-s %4.1f%%\n",
                  H, I, f.moe_topk, E, f.tokens, threads, t.wall * 1e6, weights / t.cpu / 1e9, gbs,
                  100 * gbs / bw[ti].wall_gbs, 100 * (bytes_per_call / t.cpu / 1e9) / bw[ti].per_cpu_gbs);
    }
  }
  return 0;
}
