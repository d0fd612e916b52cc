// What the GPU engine's tests share (tests/engine/cuda/*_test.cc): skipping where no GPU is
// visible, relative errors, random inputs and host <-> device copies of test data.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/engine/relative_error.h"

#define REQUIRE_GPU()                                                     \
  do {                                                                    \
    if (exl3::cuda::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible"; \
  } while (0)

namespace exl3::engine::cuda {

using testing::RelativeError;

inline std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Greedy runs of the same prompts (testing::RunGreedy's rows, [sequence][step][vocab]) on the GPU
// and the CPU model: every row's greedy token the same (a fatal failure names the first that is
// not) and the worst row's relative error in *worst.
inline void CompareGreedyRows(const std::vector<std::vector<std::vector<float>>>& gpu,
                              const std::vector<std::vector<std::vector<float>>>& cpu, double* worst) {
  *worst = 0;
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t s = 0; s < gpu.size(); ++s) {
    ASSERT_EQ(gpu[s].size(), cpu[s].size());
    for (size_t r = 0; r < gpu[s].size(); ++r) {
      const std::vector<float>& g = gpu[s][r];
      const std::vector<float>& c = cpu[s][r];
      *worst = std::max(*worst, RelativeError(g, c));
      ASSERT_EQ(std::max_element(g.begin(), g.end()) - g.begin(), std::max_element(c.begin(), c.end()) - c.begin())
          << "sequence " << s << " step " << r;
    }
  }
}

template <typename T>
DeviceArray<T> ToDevice(const std::vector<T>& v) {
  DeviceArray<T> d;
  EXPECT_TRUE(d.Upload(v).ok());
  return d;
}

// After the device's work so far.
template <typename T>
std::vector<T> ToHost(const T* d, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(exl3::cuda::Synchronize().ok());
  EXPECT_TRUE(exl3::cuda::CopyToHost(v.data(), d, n * sizeof(T)).ok());
  return v;
}
template <typename T>
std::vector<T> ToHost(const DeviceArray<T>& d, size_t n) {
  return ToHost(d.get(), n);
}

// IEEE binary16 bits to float (references read the values the kernels read from the fp16 cache).
inline float HalfToFloat(KvHalf h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float v;
  if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    v = mantissa != 0 ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return (h & 0x8000) != 0 ? -v : v;
}

// The layer tests that run several sequences on block tables of their own: a sequence's next n
// tokens (ids 1) in a step, wanting logits.
struct NextChunk {
  int seq, n;
};
// The step of `chunks`, each continuing its sequence at *next_position[seq] (advanced past it) on
// tables[seq].
inline StepBatch NextChunks(const std::vector<NextChunk>& chunks, const std::vector<std::vector<int32_t>>& tables,
                            std::vector<int>* next_position) {
  StepBatch batch;
  for (const NextChunk& c : chunks) {
    SequenceChunk sc;
    sc.sequence_id = c.seq;
    sc.tokens.assign(c.n, 1);
    sc.start_position = (*next_position)[c.seq];
    sc.block_table = tables[c.seq];
    sc.wants_logits = true;
    (*next_position)[c.seq] += c.n;
    batch.chunks.push_back(sc);
  }
  return batch;
}

// A flattened step's paged-cache facts as the attention kernels read them (AttentionTokens): each
// token's position, first attended position (0), the offset of its chunk's block table in
// `tables` (every chunk's, in chunk order) and its cache slot.
struct PagedStepFacts {
  std::vector<int32_t> positions, first, table_offset, slot, tables;
};
inline PagedStepFacts PagedStepFactsOf(const StepBatch& batch, const StepTokens& tokens, int block_size) {
  const int T = tokens.num_tokens, bs = block_size;
  PagedStepFacts f;
  f.positions = tokens.positions;
  f.first.assign(T, 0);
  f.table_offset.resize(T);
  f.slot.resize(T);
  std::vector<int> chunk_offset;
  for (const SequenceChunk& c : batch.chunks) {
    chunk_offset.push_back(static_cast<int>(f.tables.size()));
    f.tables.insert(f.tables.end(), c.block_table.begin(), c.block_table.end());
  }
  for (int t = 0; t < T; ++t) {
    f.table_offset[t] = chunk_offset[tokens.chunk_of[t]];
    const std::vector<int32_t>& table = tokens.block_table(t);
    f.slot[t] = table[f.positions[t] / bs] * bs + f.positions[t] % bs;
  }
  return f;
}

// PagedStepFacts on the device, with the positions per split of `splits` splits of `span` (the
// most positions a token attends to).
struct DeviceStepFacts {
  DeviceArray<int32_t> positions, first, table_offset, tables, slot, split_positions;

  AttentionTokens tokens(int block_size) const {
    return AttentionTokens{positions.get(), first.get(), table_offset.get(), tables.get(), block_size};
  }
};
inline DeviceStepFacts UploadStepFacts(const PagedStepFacts& f, int span, int splits) {
  DeviceStepFacts d;
  d.positions = ToDevice(f.positions);
  d.first = ToDevice(f.first);
  d.table_offset = ToDevice(f.table_offset);
  d.tables = ToDevice(f.tables);
  d.slot = ToDevice(f.slot);
  d.split_positions = ToDevice(std::vector<int32_t>{(span + splits - 1) / splits});
  return d;
}

// Every layer's cache of the tests that run a model's layers on both engines: the CPU engine's
// paged one and the GPU's fp16 one, zeroed (layer l's from layer_offset[l]).
struct LayerCaches {
  std::unique_ptr<PagedKvCache> cpu;
  DeviceArray<KvHalf> gpu;
  std::vector<size_t> layer_offset;

  KvHalf* gpu_layer(int l) { return gpu.get() + layer_offset[l]; }
};
inline LayerCaches LayerCachesOf(const ModelConfig& cfg, const KvCacheShape& shape) {
  const int L = cfg.num_layers, bs = shape.block_size;
  std::vector<int> widths(L);
  for (int l = 0; l < L; ++l) widths[l] = cfg.KvWidth(l);
  std::vector<KvLayerShape> cpu_layers(L);
  for (int l = 0; l < L; ++l) cpu_layers[l] = {widths[l], cfg.KvBlockFloats(l, bs)};
  LayerCaches c;
  c.cpu = std::make_unique<PagedKvCache>(std::move(cpu_layers), shape);
  const size_t slots = static_cast<size_t>(shape.num_blocks) * bs;
  c.layer_offset.assign(L + 1, 0);
  for (int l = 0; l < L; ++l) c.layer_offset[l + 1] = c.layer_offset[l] + slots * widths[l];
  c.gpu = ToDevice(std::vector<KvHalf>(std::max<size_t>(c.layer_offset[L], 1), 0));
  return c;
}

// A drafting walk teacher-forced along `ids` (the MTP drafting tests): sequence `id`'s positions
// start .. start + kept - 1 are kept; their span asks for `num_drafts` drafts.
inline MtpSpan TeacherForcedSpan(int64_t id, const std::vector<int32_t>& ids, int start, int kept,
                                 const std::vector<int32_t>& table, int num_drafts) {
  MtpSpan span;
  span.sequence_id = id;
  span.start_position = start;
  span.num_positions = kept;
  span.next_tokens.assign(ids.begin() + start + 1, ids.begin() + start + 1 + kept);
  span.block_table = table;
  span.num_drafts = num_drafts;
  return span;
}

// The walk's next step after the last kept position `last`: one verify chunk of the token at
// last + 1 and the drafts, a logit row each, states kept.
inline StepBatch TeacherForcedVerify(int64_t id, const std::vector<int32_t>& ids, int last,
                                     const std::vector<int32_t>& drafts, const std::vector<int32_t>& table) {
  StepBatch batch;
  batch.keep_hidden_states = true;
  SequenceChunk& verify = batch.chunks.emplace_back();
  verify.sequence_id = id;
  verify.start_position = last + 1;
  verify.tokens = {ids[last + 1]};
  verify.tokens.insert(verify.tokens.end(), drafts.begin(), drafts.end());
  verify.block_table = table;
  verify.wants_logits = true;
  verify.num_logit_rows = 1 + static_cast<int>(drafts.size());
  return batch;
}

}  // namespace exl3::engine::cuda
