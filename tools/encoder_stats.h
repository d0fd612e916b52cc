// Statistical comparison of the trellis encoder with a one-sample quality anchor (exllamav3's
// MSE on 2048 Gaussian tiles, docs/format.md): per-tile errors on many tiles, the expected MSE with
// a standard error (control variates on the sample's extreme values, whose expectations are known
// in closed form), and the sampling distribution of "best-of-grid MSE on 2048 tiles" by bootstrap,
// with the anchor's percentile in it. Part of exl3-encoder-bench (--stats).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codebook.h"

namespace exl3 {

struct EncoderStatsOptions {
  std::vector<int> bits;
  std::vector<Codebook> codebooks;
  size_t tiles = 10240;          // tiles of N(0, 1) values encoded at every scale
  size_t search_tiles = 0;       // tiles for the grid search of the centre scale (0: the
                                 // converter's DefaultGlobalScale)
  int half_width = 2;            // grid points evaluated on all tiles: centre +- this many, then
                                 // extended until the best has this many on each side
  size_t sample_tiles = 2048;    // the anchor's sample size
  int bootstrap = 4000;          // bootstrap replicates of sample_tiles tiles
  size_t optimum_tiles = 0;      // tiles compared with the exact tail-biting optimum (K >= 5)
  int paired_window = 0;         // > 0: also encode paired_tiles tiles at the best scale with
  size_t paired_tiles = 512;     // this pass-1 window and report the MSE ratio (paired)
  int threads = 1;
  uint32_t seed = 12345;
  std::string cache;             // optional CSV of per-tile MSEs: columns found there (same seed
                                 // and tile count) are not encoded again; all are written back
};

// anchor[K-1][codebook]: the one-sample MSE to place in our sampling distribution. Prints Markdown.
void RunEncoderStats(const EncoderStatsOptions& opts, const double anchor[8][3]);

}  // namespace exl3
