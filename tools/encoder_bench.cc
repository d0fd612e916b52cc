// exl3-encoder-bench: quality (MSE on i.i.d. unit Gaussian tiles at the best global scale) and
// speed (tiles/s per core) of the CPU trellis encoder, printed as Markdown for
// bench/results/encoder.md. See --help.
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/command_line.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/codebook.h"
#include "model/encoder/trellis_encoder.h"
#include "tools/encoder_stats.h"

ABSL_FLAG(std::string, bits, "1,2,3,4,5,6,7,8", "comma-separated K values for the quality table");
ABSL_FLAG(std::string, codebooks, "3inst,mcg,mul1", "comma-separated codebooks");
ABSL_FLAG(int, tiles, 256, "tiles evaluated at the chosen scale (and its two grid neighbours)");
ABSL_FLAG(int, high_k_tiles, 128, "tiles used instead of --tiles for K >= 6");
ABSL_FLAG(int, search_tiles, 24, "tiles used for the scale grid search");
ABSL_FLAG(int, final_grid, 1,
          "final evaluation at the searched scale +- this many grid steps (extended while the best "
          "is at an end)");
ABSL_FLAG(int, threads, 0, "encoder threads for the quality table (0: all cores)");
ABSL_FLAG(int, speed_tiles, 48, "tiles encoded single-threaded for the speed figures");
ABSL_FLAG(std::string, speed_bits, "2,3,4", "K values for the speed figures (empty: skip)");
ABSL_FLAG(std::string, simd, "best", "Viterbi step for the speed figures: best, avx512, avx2, portable");
ABSL_FLAG(bool, quality, true, "run the quality table");
ABSL_FLAG(uint32_t, seed, 12345, "random seed for the Gaussian tiles");
ABSL_FLAG(bool, stats, false,
          "statistical comparison with the anchor at --bits/--codebooks (see encoder_stats.h)");
ABSL_FLAG(int, stats_tiles, 10240, "--stats: tiles encoded at every evaluated scale");
ABSL_FLAG(int, stats_search_tiles, 0,
          "--stats: tiles for the grid search of the centre scale (0: the converter's default)");
ABSL_FLAG(int, stats_half_width, 2, "--stats: grid points each side of the centre evaluated");
ABSL_FLAG(int, stats_bootstrap, 4000, "--stats: bootstrap replicates of 2048 tiles");
ABSL_FLAG(int, stats_optimum_tiles, 0, "--stats: tiles compared with the exact optimum (K >= 5)");
ABSL_FLAG(int, stats_paired_window, 0,
          "--stats: also compare the default encoder with this pass-1 window, paired, at the best "
          "scale on --stats_paired_tiles tiles (0: skip)");
ABSL_FLAG(int, stats_paired_tiles, 512, "--stats: tiles for --stats_paired_window");
ABSL_FLAG(std::string, stats_cache, "",
          "--stats: CSV of per-tile MSEs, read (columns present are not encoded again) and written");

namespace {

// exllamav3's own encoder on an H200 (docs/format.md, "Encoder quality anchor"): [K-1][cb].
constexpr double kAnchor[8][3] = {
    {2.684e-1, 2.681e-1, 2.738e-1}, {6.910e-2, 6.875e-2, 6.866e-2},
    {1.781e-2, 1.747e-2, 1.745e-2}, {4.628e-3, 4.541e-3, 4.468e-3},
    {1.205e-3, 1.193e-3, 1.149e-3}, {3.197e-4, 3.161e-4, 2.993e-4},
    {8.522e-5, 8.476e-5, 7.981e-5}, {2.293e-5, 2.294e-5, 2.090e-5},
};

std::vector<float> Gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

// The part of the MSE no encoder can avoid: values beyond the codebook's range (|x * scale| >
// max |codebook value|) are at least that far from any reconstruction.
double ClipFloor(const std::vector<float>& x, size_t tiles, exl3::Codebook cb, double scale) {
  const float* t = exl3::CodebookTable(cb);
  double lo = 0, hi = 0;
  for (int s = 0; s < 65536; ++s) lo = std::min<double>(lo, t[s]), hi = std::max<double>(hi, t[s]);
  double sum = 0;
  const size_t n = tiles * exl3::kTileElems;
  for (size_t i = 0; i < n; ++i) {
    const double v = x[i] * scale;
    const double d = v > hi ? v - hi : (v < lo ? lo - v : 0.0);
    sum += d * d;
  }
  return sum / (scale * scale) / static_cast<double>(n);
}

// MSE in unit-Gaussian terms of encoding x * scale (the codebook value v stands for v / scale).
double MseAtScale(const std::vector<float>& x, size_t tiles, int K, exl3::Codebook cb,
                  double scale, int threads) {
  std::vector<float> xs(tiles * exl3::kTileElems);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(x[i] * scale);
  std::vector<uint16_t> words(tiles * 16 * K);
  const double err = exl3::EncodeTiles(xs.data(), tiles, K, cb, words.data(), nullptr, threads);
  return err / (scale * scale) / static_cast<double>(xs.size());
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(p, &v)) {
      std::fprintf(stderr, "exl3-encoder-bench: bad integer list '%s'\n", s.c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  exl3::ConfigureFlagsUsage(
      "exl3-encoder-bench",
      "Benchmarks the CPU trellis encoder.\n"
      "Quality: for each K and codebook, a grid search of the global scale (0.70..1.60 step 0.05,\n"
      "the tile values x ~ N(0,1) are encoded as x*scale) on --search_tiles tiles, then the best\n"
      "scale and its two neighbours on --tiles tiles (--high_k_tiles for K >= 6); reports the\n"
      "best MSE beside exllamav3's, the ratio to 4^-K, and the share of the MSE that comes from\n"
      "values beyond the codebook's range (no encoder can avoid it; it dominates at high K).\n"
      "Speed: single-threaded tiles/s at --speed_bits and the implied time for a 4096x2048 matrix.\n"
      "--stats: expected MSE with standard errors on --stats_tiles tiles and the sampling\n"
      "distribution of a 2048-tile result (bootstrap), with the anchor's percentile in it.",
      "tools/encoder_bench");
  absl::ParseCommandLine(argc, argv);
  const std::vector<int> bits = ParseInts(absl::GetFlag(FLAGS_bits));
  std::vector<exl3::Codebook> cbs;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_codebooks), ',', absl::SkipEmpty())) {
    exl3::Codebook cb;
    if (!exl3::ParseCodebook(std::string_view(p.data(), p.size()), &cb)) {
      std::fprintf(stderr, "exl3-encoder-bench: unknown codebook '%s'\n", std::string(p).c_str());
      return 2;
    }
    cbs.push_back(cb);
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  const size_t max_tiles = std::max(absl::GetFlag(FLAGS_tiles), absl::GetFlag(FLAGS_search_tiles));
  const std::vector<float> x = Gaussian(max_tiles * exl3::kTileElems, absl::GetFlag(FLAGS_seed));

  if (absl::GetFlag(FLAGS_quality)) {
    std::printf("| K | codebook | tiles | best scale | MSE (ours) | ours / 4^-K | exllamav3 MSE | "
                "exllamav3 / 4^-K | ours / exllamav3 | clipped share |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    std::fflush(stdout);
    for (int K : bits) {
      for (exl3::Codebook cb : cbs) {
        const size_t search = std::min<size_t>(absl::GetFlag(FLAGS_search_tiles), max_tiles);
        int best_i = 0;
        double best = 1e30;
        for (int i = 0; i <= 18; ++i) {
          const double mse = MseAtScale(x, search, K, cb, 0.70 + 0.05 * i, threads);
          if (mse < best) best = mse, best_i = i;
        }
        const size_t tiles = std::min<size_t>(
            K >= 6 ? absl::GetFlag(FLAGS_high_k_tiles) : absl::GetFlag(FLAGS_tiles), max_tiles);
        // The searched scale +- final_grid on all the tiles, extended while the best is at an
        // end of that window (a small search sample can centre it badly at high K).
        double final_mse = 1e30, final_scale = 0;
        const int fg = absl::GetFlag(FLAGS_final_grid);
        int lo = std::max(0, best_i - fg), hi = std::min(18, best_i + fg), final_i = lo;
        std::vector<double> mse_at(19, -1.0);
        for (;;) {
          for (int i = lo; i <= hi; ++i) {
            if (mse_at[i] < 0) mse_at[i] = MseAtScale(x, tiles, K, cb, 0.70 + 0.05 * i, threads);
            if (mse_at[i] < final_mse) final_mse = mse_at[i], final_i = i;
          }
          if (final_i == lo && lo > 0) --lo;
          else if (final_i == hi && hi < 18) ++hi;
          else break;
        }
        final_scale = 0.70 + 0.05 * final_i;
        const double bound = std::pow(4.0, -K);
        const double anchor = kAnchor[K - 1][static_cast<int>(cb)];
        const double clip = ClipFloor(x, tiles, cb, final_scale);
        std::printf("| %d | %s | %zu | %.2f | %.3e | %.3f | %.3e | %.3f | %.3f | %.1f%% |\n",
                    K, std::string(exl3::CodebookName(cb)).c_str(), tiles, final_scale, final_mse,
                    final_mse / bound, anchor, anchor / bound, final_mse / anchor,
                    100.0 * clip / final_mse);
        std::fflush(stdout);
      }
    }
  }

  if (absl::GetFlag(FLAGS_stats)) {
    exl3::EncoderStatsOptions so;
    so.bits = bits;
    so.codebooks = cbs;
    so.tiles = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_stats_tiles)));
    so.search_tiles = static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_stats_search_tiles)));
    so.half_width = std::max(0, absl::GetFlag(FLAGS_stats_half_width));
    so.bootstrap = std::max(1, absl::GetFlag(FLAGS_stats_bootstrap));
    so.optimum_tiles = static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_stats_optimum_tiles)));
    so.threads = threads > 0 ? threads : 1;
    so.seed = absl::GetFlag(FLAGS_seed);
    so.cache = absl::GetFlag(FLAGS_stats_cache);
    so.paired_window = std::max(0, absl::GetFlag(FLAGS_stats_paired_window));
    so.paired_tiles = static_cast<size_t>(std::max(2, absl::GetFlag(FLAGS_stats_paired_tiles)));
    exl3::RunEncoderStats(so, kAnchor);
  }

  const std::vector<int> speed_bits = ParseInts(absl::GetFlag(FLAGS_speed_bits));
  if (!speed_bits.empty()) {
    using Simd = exl3::TileEncoder::Simd;
    const std::string simd_name = absl::GetFlag(FLAGS_simd);
    const Simd simd = simd_name == "avx512" ? Simd::kAvx512
                      : simd_name == "avx2" ? Simd::kAvx2
                      : simd_name == "portable" ? Simd::kPortable : Simd::kBest;
    if (!exl3::TileEncoder::SimdAvailable(simd)) {
      std::fprintf(stderr, "exl3-encoder-bench: this CPU lacks --simd=%s\n", simd_name.c_str());
      return 2;
    }
    const int n = absl::GetFlag(FLAGS_speed_tiles);
    const std::vector<float> xs = Gaussian(static_cast<size_t>(n) * exl3::kTileElems, 99);
    std::printf("\n| K | codebook | tiles | tiles/s per core (best chunk, thread CPU time) | 4096x2048 matrix (32768 tiles), 1 core |\n");
    std::printf("| --- | --- | --- | --- | --- |\n");
    for (int K : speed_bits) {
      for (exl3::Codebook cb : cbs) {
        exl3::TileEncoder enc(K, cb, simd);
        std::vector<uint16_t> words(16 * K);
        std::vector<float> tile(exl3::kTileElems);
        enc.Encode(xs.data(), words.data());  // warm up (codebook table, caches)
        // Thread CPU time, so that other processes on a shared machine count less; the figure
        // is the best of 4 chunks of n/4 tiles (noisy shared machines), the mean is printed too.
        const int chunk = std::max(1, n / 4);
        double best_chunk = 1e30, sec = 0;
        for (int c = 0; c < 4; ++c) {
          const double t0 = ThreadCpuSeconds();
          for (int i = c * chunk; i < (c + 1) * chunk && i < n; ++i) {
            for (int e = 0; e < exl3::kTileElems; ++e) tile[e] = xs[i * exl3::kTileElems + e] * 1.2f;
            enc.Encode(tile.data(), words.data());
          }
          const double dt = ThreadCpuSeconds() - t0;
          sec += dt;
          best_chunk = std::min(best_chunk, dt);
        }
        const double tps = chunk / best_chunk;
        std::printf("| %d | %s | %d | %.1f (mean %.1f) | %.0f s |\n", K,
                    std::string(exl3::CodebookName(cb)).c_str(), 4 * chunk, tps, 4 * chunk / sec,
                    32768.0 / tps);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
