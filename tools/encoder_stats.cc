#include "tools/encoder_stats.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "kernels/trellis_tile.h"
#include "model/encoder/layer_quantizer.h"
#include "model/encoder/trellis_encoder.h"

namespace exl3 {
namespace {

constexpr int kGridPoints = 19;  // scales 0.70 .. 1.60 step 0.05, as the anchor's protocol
double GridScale(int i) { return 0.70 + 0.05 * i; }

double Q(double t) { return 0.5 * std::erfc(t / std::sqrt(2.0)); }
double Phi(double t) { return std::exp(-0.5 * t * t) / std::sqrt(2.0 * M_PI); }
// E[(x - t)^2 ; x > t] for x ~ N(0, 1).
double TailSquare(double t) { return (1.0 + t * t) * Q(t) - t * Phi(t); }

// Control variates: functions of the tile's values alone (not of the encoder) whose expectations
// are known exactly. The tile error's variance at high K comes from the few extreme values, so
// regressing on these removes most of it. z[0]: the squared excess beyond the codebook's range
// (in unit terms, at scale s); z[1..]: counts of |x| in the bins below.
constexpr double kBinEdges[] = {3.0, 3.25, 3.5, 3.75, 4.0, 4.25, 4.5};
constexpr int kBins = 7;  // [3.0, 3.25), ..., [4.25, 4.5), [4.5, inf)
constexpr int kVariates = 1 + kBins;

struct CodebookRange {
  double lo, hi;
};
CodebookRange RangeOf(Codebook cb) {
  const float* t = CodebookTable(cb);
  CodebookRange r{0, 0};
  for (int s = 0; s < 65536; ++s) r.lo = std::min<double>(r.lo, t[s]), r.hi = std::max<double>(r.hi, t[s]);
  return r;
}

void TileVariates(const float* x, CodebookRange range, double scale, double z[kVariates]) {
  std::fill(z, z + kVariates, 0.0);
  const double hi = range.hi / scale, lo = range.lo / scale;
  for (int e = 0; e < kTileElems; ++e) {
    const double v = x[e];
    if (v > hi) z[0] += (v - hi) * (v - hi);
    if (v < lo) z[0] += (lo - v) * (lo - v);
    const double a = std::fabs(v);
    for (int b = kBins - 1; b >= 0; --b) {
      if (a >= kBinEdges[b]) {
        z[1 + b] += 1;
        break;
      }
    }
  }
}

void VariateMeans(CodebookRange range, double scale, double mean[kVariates]) {
  mean[0] = kTileElems * (TailSquare(range.hi / scale) + TailSquare(-range.lo / scale));
  for (int b = 0; b < kBins; ++b) {
    const double upper = b + 1 < kBins ? Q(kBinEdges[b + 1]) : 0.0;
    mean[1 + b] = kTileElems * 2.0 * (Q(kBinEdges[b]) - upper);
  }
}

// Solves the symmetric positive system A x = b (n <= 9) by Gauss-Jordan; returns A^-1 in inv.
void Invert(std::vector<double> a, int n, std::vector<double>* inv) {
  inv->assign(n * n, 0.0);
  for (int i = 0; i < n; ++i) (*inv)[i * n + i] = 1.0;
  for (int c = 0; c < n; ++c) {
    int p = c;
    for (int r = c + 1; r < n; ++r)
      if (std::fabs(a[r * n + c]) > std::fabs(a[p * n + c])) p = r;
    for (int k = 0; k < n; ++k) std::swap(a[c * n + k], a[p * n + k]), std::swap((*inv)[c * n + k], (*inv)[p * n + k]);
    const double d = a[c * n + c];
    if (d == 0.0) continue;  // a variate that never occurs: its row stays zero
    for (int k = 0; k < n; ++k) a[c * n + k] /= d, (*inv)[c * n + k] /= d;
    for (int r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = a[r * n + c];
      for (int k = 0; k < n; ++k) a[r * n + k] -= f * a[c * n + k], (*inv)[r * n + k] -= f * (*inv)[c * n + k];
    }
  }
}

struct Estimate {
  double mean, se;        // plain sample mean of the tile MSE and its standard error
  double cv_mean, cv_se;  // control-variate estimate of the expected MSE
};

// y: per-tile MSE (unit terms). Regression of y on the centred variates; the intercept is the
// control-variate estimate of E[y].
Estimate EstimateMse(const std::vector<double>& y, const std::vector<float>& x, CodebookRange range,
                     double scale) {
  const size_t n = y.size();
  constexpr int p = 1 + kVariates;
  double mu[kVariates];
  VariateMeans(range, scale, mu);
  std::vector<double> xtx(p * p, 0.0), xty(p, 0.0);
  std::vector<double> rows(n * p);
  std::vector<double> z(n * kVariates);
  // A variate non-zero in fewer than kMinTiles tiles is left out (its column would be nearly
  // collinear with the intercept); that only costs variance reduction, not bias.
  constexpr size_t kMinTiles = 10;
  size_t seen[kVariates] = {};
  for (size_t i = 0; i < n; ++i) {
    TileVariates(x.data() + i * kTileElems, range, scale, &z[i * kVariates]);
    for (int j = 0; j < kVariates; ++j) seen[j] += z[i * kVariates + j] != 0.0;
  }
  for (size_t i = 0; i < n; ++i) {
    double* row = &rows[i * p];
    row[0] = 1.0;
    for (int j = 0; j < kVariates; ++j)
      row[1 + j] = seen[j] >= kMinTiles ? z[i * kVariates + j] - mu[j] : 0.0;
    for (int a = 0; a < p; ++a) {
      xty[a] += row[a] * y[i];
      for (int b = 0; b < p; ++b) xtx[a * p + b] += row[a] * row[b];
    }
  }
  for (int j = 1; j < p; ++j)
    if (xtx[j * p + j] == 0.0) xtx[j * p + j] = 1.0;
  std::vector<double> inv;
  Invert(xtx, p, &inv);
  std::vector<double> beta(p, 0.0);
  for (int a = 0; a < p; ++a)
    for (int b = 0; b < p; ++b) beta[a] += inv[a * p + b] * xty[b];
  double sum = 0, sum2 = 0, rss = 0;
  for (size_t i = 0; i < n; ++i) {
    sum += y[i];
    sum2 += y[i] * y[i];
    double fit = 0;
    for (int a = 0; a < p; ++a) fit += beta[a] * rows[i * p + a];
    rss += (y[i] - fit) * (y[i] - fit);
  }
  Estimate e;
  e.mean = sum / n;
  e.se = std::sqrt(std::max(0.0, sum2 / n - e.mean * e.mean) / (n - 1));
  e.cv_mean = beta[0];
  e.cv_se = std::sqrt(rss / (n - p) * inv[0]);
  return e;
}

// Per-tile MSE (unit terms) of x * scale, encoded by `threads` threads.
std::vector<double> TileMse(const std::vector<float>& x, size_t tiles, int K, Codebook cb,
                            double scale, int threads) {
  std::vector<double> out(tiles);
  std::atomic<size_t> next{0};
  auto worker = [&]() {
    TileEncoder enc(K, cb);
    std::vector<uint16_t> words(16 * K);
    float xs[kTileElems];
    for (size_t i = next.fetch_add(1); i < tiles; i = next.fetch_add(1)) {
      for (int e = 0; e < kTileElems; ++e) xs[e] = static_cast<float>(x[i * kTileElems + e] * scale);
      out[i] = enc.Encode(xs, words.data()) / (scale * scale) / kTileElems;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  return out;
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * (v.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  const double f = pos - i;
  return i + 1 < v.size() ? v[i] * (1 - f) + v[i + 1] * f : v.back();
}

// Per-tile MSE columns keyed "K{K}_{codebook}_{scale}", for --stats_cache. The first line records
// the seed and tile count; a cache made with others is ignored.
using Columns = std::map<std::string, std::vector<double>>;

std::string ColumnName(int K, Codebook cb, double scale) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "K%d_%s_%.2f", K, std::string(CodebookName(cb)).c_str(), scale);
  return buf;
}

std::string CacheTag(uint32_t seed, size_t tiles) {
  return "# exl3-encoder-bench per-tile MSE, seed=" + std::to_string(seed) +
         " tiles=" + std::to_string(tiles);
}

Columns LoadCache(const std::string& path, uint32_t seed, size_t tiles) {
  Columns cols;
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line) || line != CacheTag(seed, tiles)) return cols;
  if (!std::getline(in, line)) return cols;
  std::vector<std::string> names;
  std::stringstream hs(line);
  std::string cell;
  std::getline(hs, cell, ',');  // "tile"
  while (std::getline(hs, cell, ',')) names.push_back(cell);
  std::vector<std::vector<double>> data(names.size());
  while (std::getline(in, line)) {
    std::stringstream ls(line);
    std::getline(ls, cell, ',');
    for (size_t j = 0; j < names.size() && std::getline(ls, cell, ','); ++j)
      data[j].push_back(std::strtod(cell.c_str(), nullptr));
  }
  for (size_t j = 0; j < names.size(); ++j)
    if (data[j].size() == tiles) cols[names[j]] = std::move(data[j]);
  return cols;
}

void SaveCache(const std::string& path, uint32_t seed, size_t tiles, const Columns& cols) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "exl3-encoder-bench: cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f, "%s\ntile", CacheTag(seed, tiles).c_str());
  for (const auto& [name, col] : cols) std::fprintf(f, ",%s", name.c_str());
  std::fprintf(f, "\n");
  for (size_t i = 0; i < tiles; ++i) {
    std::fprintf(f, "%zu", i);
    for (const auto& [name, col] : cols) std::fprintf(f, ",%.6e", col[i]);
    std::fprintf(f, "\n");
  }
  std::fclose(f);
}

struct Config {
  int K;
  Codebook cb;
  std::vector<int> grid;                  // grid indices evaluated on all tiles
  std::vector<std::vector<double>> mse;   // [scale][tile]
  double best_scale;                      // lowest expected (control-variate) MSE
  double expected;                        // that MSE
  double anchor;
};

struct Bootstrap {
  std::vector<std::vector<double>> reps;  // [config][replicate]: best-of-grid MSE
  std::vector<int> edge;                  // per config: replicates whose best is an end of the grid
  std::vector<double> joint;              // per replicate: mean over configs of log(ours / anchor)
  std::vector<double> joint_indep;        // the same with independent tiles per config
};

// weights: per tile, for drawing (empty: uniform).
Bootstrap RunBootstrap(const std::vector<Config>& configs, size_t n, size_t m, int B,
                       const std::vector<double>& weights, uint64_t seed) {
  Bootstrap bs;
  bs.reps.assign(configs.size(), std::vector<double>(B));
  bs.edge.assign(configs.size(), 0);
  bs.joint.assign(B, 0.0);
  bs.joint_indep.assign(B, 0.0);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> uniform(0, n - 1);
  std::discrete_distribution<size_t> weighted(weights.begin(), weights.end());
  auto draw = [&](std::vector<size_t>* idx) {
    for (size_t& i : *idx) i = weights.empty() ? uniform(rng) : weighted(rng);
  };
  auto best_of_grid = [&](const Config& cf, const std::vector<size_t>& idx, size_t* best_j) {
    double best = 1e30;
    for (size_t j = 0; j < cf.mse.size(); ++j) {
      double s = 0;
      for (size_t i : idx) s += cf.mse[j][i];
      if (s < best) best = s, *best_j = j;
    }
    return best / idx.size();
  };
  std::vector<size_t> idx(m);
  for (int b = 0; b < B; ++b) {
    draw(&idx);
    for (size_t c = 0; c < configs.size(); ++c) {
      const Config& cf = configs[c];
      size_t j = 0;
      bs.reps[c][b] = best_of_grid(cf, idx, &j);
      if ((j == 0 && cf.grid.front() > 0) || (j + 1 == cf.grid.size() && cf.grid.back() < kGridPoints - 1))
        ++bs.edge[c];
      bs.joint[b] += std::log(bs.reps[c][b] / cf.anchor) / configs.size();
    }
    for (const Config& cf : configs) {
      draw(&idx);
      size_t j = 0;
      bs.joint_indep[b] += std::log(best_of_grid(cf, idx, &j) / cf.anchor) / configs.size();
    }
  }
  return bs;
}

// Post-stratification weights: tiles are classed by their largest |x|; each class gets its
// exact probability (P(max |x| < a) = (1 - 2 Q(a))^256), shared equally by its tiles. A class
// with no tile in the pool passes its probability to the class below. Prints the classes.
std::vector<double> TailWeights(const std::vector<float>& x, size_t n) {
  constexpr double kEdges[] = {3.0, 3.5, 3.75, 4.0, 4.25, 4.5, 4.75, 5.0};
  constexpr int kClasses = 9;
  std::vector<int> cls(n);
  std::vector<size_t> count(kClasses, 0);
  for (size_t i = 0; i < n; ++i) {
    double mx = 0;
    for (int e = 0; e < kTileElems; ++e) mx = std::max(mx, std::fabs(static_cast<double>(x[i * kTileElems + e])));
    int c = 0;
    while (c < kClasses - 1 && mx >= kEdges[c]) ++c;
    cls[i] = c;
    ++count[c];
  }
  auto below = [](double a) { return std::pow(1.0 - 2.0 * Q(a), kTileElems); };
  std::vector<double> prob(kClasses);
  for (int c = 0; c < kClasses; ++c) {
    const double hi = c < kClasses - 1 ? below(kEdges[c]) : 1.0;
    const double lo = c > 0 ? below(kEdges[c - 1]) : 0.0;
    prob[c] = hi - lo;
  }
  std::printf("\nTiles by their largest |x| (pool / expected): ");
  for (int c = 0; c < kClasses; ++c) {
    std::printf("%s%s%.2f: %zu / %.1f", c ? ", " : "", c < kClasses - 1 ? "< " : ">= ",
                c < kClasses - 1 ? kEdges[c] : kEdges[kClasses - 2], count[c], prob[c] * n);
  }
  std::printf(".\n");
  std::vector<double> moved = prob;
  for (int c = kClasses - 1; c > 0; --c) {
    if (count[c] == 0) moved[c - 1] += moved[c], moved[c] = 0;
  }
  std::vector<double> w(n);
  for (size_t i = 0; i < n; ++i) w[i] = moved[cls[i]] / count[cls[i]];
  return w;
}

}  // namespace

void RunEncoderStats(const EncoderStatsOptions& opts, const double anchor[8][3]) {
  const size_t n = opts.tiles;
  std::vector<float> x(n * kTileElems);
  {
    std::mt19937 rng(opts.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x) v = nd(rng);
  }
  Columns cache_cols;
  if (!opts.cache.empty()) cache_cols = LoadCache(opts.cache, opts.seed, n);
  Columns* cache = &cache_cols;
  std::vector<Config> configs;
  std::printf("### Expected MSE (%zu tiles, the same tiles for every K and codebook, seed %u)\n\n",
              n, opts.seed);
  std::printf("| K | codebook | scale | MSE over all tiles ± s.e. | control-variate MSE ± s.e. | "
              "exllamav3 | expected / exllamav3 | clipped part (expected) |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  std::fflush(stdout);
  for (int K : opts.bits) {
    for (Codebook cb : opts.codebooks) {
      Config c;
      c.K = K;
      c.cb = cb;
      c.anchor = anchor[K - 1][static_cast<int>(cb)];
      const CodebookRange range = RangeOf(cb);
      // Centre: the best grid scale on the first search_tiles tiles, or (0 search tiles) the
      // converter's default scale. Then the grid centre +- half_width on all tiles, extended one
      // point at a time while the best (control-variate) MSE is near an end of it.
      int centre = static_cast<int>(std::lround((DefaultGlobalScale(K, cb) - 0.70) / 0.05));
      const size_t search = std::min(opts.search_tiles, n);
      if (search > 0) {
        double best = 1e30;
        for (int i = 0; i < kGridPoints; ++i) {
          const std::vector<double> m = TileMse(x, search, K, cb, GridScale(i), opts.threads);
          double s = 0;
          for (double v : m) s += v;
          if (s < best) best = s, centre = i;
        }
      }
      int lo = std::max(0, centre - opts.half_width);
      int hi = std::min(kGridPoints - 1, centre + opts.half_width);
      std::map<int, Estimate> est;
      int best_i = lo;
      for (;;) {
        for (int i = lo; i <= hi; ++i) {
          if (est.count(i)) continue;
          const double scale = GridScale(i);
          std::vector<double>& col = (*cache)[ColumnName(K, cb, scale)];
          if (col.size() != n) col = TileMse(x, n, K, cb, scale, opts.threads);
          est[i] = EstimateMse(col, x, range, scale);
        }
        best_i = lo;
        for (int i = lo; i <= hi; ++i)
          if (est[i].cv_mean < est[best_i].cv_mean) best_i = i;
        // Extended until the best has half_width grid points on each side (or the grid ends).
        const int margin = std::max(1, opts.half_width);
        if (best_i - lo < margin && lo > 0) --lo;
        else if (hi - best_i < margin && hi < kGridPoints - 1) ++hi;
        else break;
      }
      for (int i = lo; i <= hi; ++i) {
        c.grid.push_back(i);
        c.mse.push_back((*cache)[ColumnName(K, cb, GridScale(i))]);
      }
      const size_t best_j = static_cast<size_t>(best_i - lo);
      const Estimate best_est = est[best_i];
      const double scale = GridScale(c.grid[best_j]);
      c.best_scale = scale;
      c.expected = best_est.cv_mean;
      double mu[kVariates];
      VariateMeans(range, scale, mu);
      std::printf("| %d | %s | %.2f | %.4e ± %.1e | %.4e ± %.1e | %.3e | %.3f ± %.3f | %.1f %% |\n",
                  K, std::string(CodebookName(cb)).c_str(), scale, best_est.mean, best_est.se,
                  best_est.cv_mean, best_est.cv_se, c.anchor, best_est.cv_mean / c.anchor,
                  best_est.cv_se / c.anchor, 100.0 * mu[0] / kTileElems / best_est.cv_mean);
      std::fflush(stdout);
      configs.push_back(std::move(c));
    }
  }

  // Bootstrap: replicates of sample_tiles tiles drawn with replacement, the same draws for every
  // configuration (as one set of tiles serves every K and codebook); in each, the best MSE over
  // the evaluated grid scales, as the anchor's protocol takes the best scale on its sample. Drawn
  // twice: from the pool as it is, and re-weighted so that the tiles' classes by largest |x| have
  // their exact probabilities (a pool with a few extreme tiles too many or too few otherwise
  // shifts the whole distribution at high K).
  const size_t m = opts.sample_tiles;  // may exceed n: drawn with replacement all the same
  const int B = opts.bootstrap;
  const std::vector<double> weights = TailWeights(x, n);
  const Bootstrap reweighted = RunBootstrap(configs, n, m, B, weights, opts.seed ^ 0x5eed);
  const Bootstrap pool = RunBootstrap(configs, n, m, B, {}, opts.seed ^ 0x5eed);
  std::printf("\n### Sampling distribution of the best-of-grid MSE on %zu tiles (%d bootstrap "
              "replicates, re-weighted)\n\n", m, B);
  std::printf("| K | codebook | grid evaluated | median | 5 %% .. 95 %% | exllamav3 | exllamav3's "
              "percentile | same, pool as drawn | disjoint %zu-tile blocks / expected | best at "
              "grid edge |\n", m);
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  auto percentile_of = [&](const std::vector<double>& r, double v) {
    return 100.0 * std::count_if(r.begin(), r.end(), [&](double a) { return a <= v; }) / r.size();
  };
  for (size_t c = 0; c < configs.size(); ++c) {
    const Config& cf = configs[c];
    const std::vector<double>& r = reweighted.reps[c];
    std::string blocks;
    for (size_t start = 0; start + m <= n; start += m) {
      double best = 1e30;
      for (const auto& col : cf.mse) {
        double s = 0;
        for (size_t i = start; i < start + m; ++i) s += col[i];
        best = std::min(best, s / m);
      }
      char buf[16];
      std::snprintf(buf, sizeof(buf), "%s%.3f", blocks.empty() ? "" : " ", best / cf.expected);
      blocks += buf;
    }
    if (blocks.empty()) blocks = "-";
    std::printf("| %d | %s | %.2f..%.2f | %.4e | %.4e .. %.4e | %.3e | %.1f %% | %.1f %% | %s | "
                "%.1f %% |\n",
                cf.K, std::string(CodebookName(cf.cb)).c_str(), GridScale(cf.grid.front()),
                GridScale(cf.grid.back()), Percentile(r, 0.5), Percentile(r, 0.05),
                Percentile(r, 0.95), cf.anchor, percentile_of(r, cf.anchor),
                percentile_of(pool.reps[c], cf.anchor), blocks.c_str(),
                100.0 * reweighted.edge[c] / B);
  }
  std::printf("\nAll rows together: per replicate, the mean over the rows of log(ours / exllamav3); "
              "the anchor is 0.\n\n| bootstrap | tiles | median | 5 %% .. 95 %% | the anchor's "
              "percentile |\n| --- | --- | --- | --- | --- |\n");
  for (const auto& [name, bs] : {std::pair<const char*, const Bootstrap*>{"re-weighted", &reweighted},
                                 {"pool as drawn", &pool}}) {
    std::printf("| %s | the same for every row | %+.4f | %+.4f .. %+.4f | %.1f %% |\n", name,
                Percentile(bs->joint, 0.5), Percentile(bs->joint, 0.05),
                Percentile(bs->joint, 0.95), percentile_of(bs->joint, 0.0));
    std::printf("| %s | independent per row | %+.4f | %+.4f .. %+.4f | %.1f %% |\n", name,
                Percentile(bs->joint_indep, 0.5), Percentile(bs->joint_indep, 0.05),
                Percentile(bs->joint_indep, 0.95), percentile_of(bs->joint_indep, 0.0));
  }
  std::fflush(stdout);

  if (opts.optimum_tiles > 0) {
    std::printf("\n### Gap to the exact tail-biting optimum (first %zu tiles, best scale)\n\n",
                opts.optimum_tiles);
    std::printf("| K | codebook | ours / optimum (total error) | tiles not optimal | worst tile | "
                "constrained passes per tile |\n| --- | --- | --- | --- | --- | --- |\n");
    for (const Config& cf : configs) {
      if (cf.K < 5) continue;  // the branch and bound needs thousands of passes at low K
      const double scale = cf.best_scale;
      TileEncoder enc(cf.K, cf.cb);
      std::vector<uint16_t> words(16 * cf.K);
      float xs[kTileElems];
      double ours = 0, opt = 0, worst = 1;
      int off = 0, passes = 0;
      const size_t t_count = std::min(opts.optimum_tiles, n);
      for (size_t t = 0; t < t_count; ++t) {
        for (int e = 0; e < kTileElems; ++e) xs[e] = static_cast<float>(x[t * kTileElems + e] * scale);
        const double a = enc.Encode(xs, words.data());
        int p = 0;
        const double o = enc.EncodeOptimal(xs, words.data(), nullptr, &p);
        ours += a, opt += o, passes += p;
        if (a > o * (1 + 1e-6)) ++off;
        worst = std::max(worst, a / o);
      }
      std::printf("| %d | %s | %.5f | %d / %zu | +%.3f %% | %.0f |\n", cf.K,
                  std::string(CodebookName(cf.cb)).c_str(), ours / opt, off, t_count,
                  100.0 * (worst - 1), static_cast<double>(passes) / t_count);
      std::fflush(stdout);
    }
  }

  if (opts.paired_window > 0) {
    // Same tiles, same scale, two encoders: the ratio of their total errors is precise even on
    // few tiles (the tiles' own variation cancels). Used to carry the expected-MSE table over
    // to an encoder change without encoding every tile again.
    const size_t t_count = std::min(opts.paired_tiles, n);
    std::printf("\n### Default encoder against pass-1 window %d (first %zu tiles, best scale, "
                "paired)\n\n", opts.paired_window, t_count);
    std::printf("| K | codebook | MSE default / MSE window %d | s.e. |\n| --- | --- | --- | --- |\n",
                opts.paired_window);
    for (const Config& cf : configs) {
      const double scale = cf.best_scale;
      TileEncoder a(cf.K, cf.cb), b(cf.K, cf.cb);
      b.set_window(opts.paired_window);
      std::vector<uint16_t> words(16 * cf.K);
      float xs[kTileElems];
      std::vector<double> ea(t_count), eb(t_count);
      double sa = 0, sb = 0;
      for (size_t t = 0; t < t_count; ++t) {
        for (int e = 0; e < kTileElems; ++e) xs[e] = static_cast<float>(x[t * kTileElems + e] * scale);
        ea[t] = a.Encode(xs, words.data());
        eb[t] = b.Encode(xs, words.data());
        sa += ea[t], sb += eb[t];
      }
      const double r = sa / sb;
      double v = 0;  // delta method: variance of the mean of (a - r b), over the mean of b
      for (size_t t = 0; t < t_count; ++t) v += (ea[t] - r * eb[t]) * (ea[t] - r * eb[t]);
      const double se = std::sqrt(v / (t_count - 1) / t_count) / (sb / t_count);
      std::printf("| %d | %s | %.5f | %.5f |\n", cf.K, std::string(CodebookName(cf.cb)).c_str(), r, se);
      std::fflush(stdout);
    }
  }

  if (!opts.cache.empty()) SaveCache(opts.cache, opts.seed, n, cache_cols);
}

}  // namespace exl3
