#include "engine/config/dsv4_config.h"

namespace exl3::engine {

int Dsv4Config::CompressRate(int layer) const {
  switch (layer_types[layer]) {
    case Dsv4LayerType::kCompressedSparse:
      return csa_compress_rate;
    case Dsv4LayerType::kHeavilyCompressed:
      return hca_compress_rate;
    default:
      return 0;
  }
}

Dsv4CacheLayout CacheLayoutFor(const Dsv4Config& cfg, Dsv4LayerType type, int block_size) {
  Dsv4CacheLayout c;
  c.token_width = cfg.head_dim;
  if (type == Dsv4LayerType::kSlidingWindow) return c;
  const bool overlapping = type == Dsv4LayerType::kCompressedSparse;
  const int m = overlapping ? cfg.csa_compress_rate : cfg.hca_compress_rate;
  c.entries_per_block = (block_size + m - 1) / m;
  int at = 0;
  c.folded = at++;
  auto accumulators = [&](Dsv4CompressorCache* k, int dim) {
    k->dim = dim;
    k->overlapping = overlapping;
    k->current = at;
    at += 2 * dim;
    if (overlapping) {
      k->next = at;
      at += 2 * dim;
    }
  };
  accumulators(&c.compressor, cfg.head_dim);
  if (overlapping) accumulators(&c.indexer, cfg.index_head_dim);
  c.accumulators_end = at;
  c.compressor.entries = at;
  at += c.entries_per_block * cfg.head_dim;
  if (overlapping) {
    c.indexer.entries = at;
    at += c.entries_per_block * cfg.index_head_dim;
  }
  c.block_width = at;
  return c;
}

}  // namespace exl3::engine
