// The GPU's delta-rule recurrence (engine/cuda/delta_rule_kernels.h) against a plain double
// reference of its formula, on fresh random inputs: both decay forms (one per head as the gated
// DeltaNet's, one per key channel as KDA's log-decay), value heads sharing key heads, key dims
// below, at and between the kernel's row groups (16, 40, 64, 128), value dims that leave a block's
// 32 columns part empty (24, 96, 160), chunks of 0, 1, 7, 8, 9 (the 8-token stage's edges), 33 and
// 64 tokens, and one of 1024 (a prefill), and a chunk that writes the row it reads (as a decode
// step in place); a verify chunk's kept states bit for bit against shorter chunks. Lines "delta
// rule ..." give every comparison.
// Skipped where no GPU is visible (ctest label gpu).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda/delta_rule_kernels.h"
#include "gtest/gtest.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

struct Case {
  int num_heads, heads_per_key_head, key_head_dim, value_head_dim;
  DeltaRuleDecay form;
};

// One (chunk, head): S [DK, DV] in place, o [tokens, DV] at out_stride.
void ReferenceHead(const std::vector<float>& conv, const std::vector<float>& beta,
                   const std::vector<float>& decay, const Case& k, const DeltaRuleShape& sh,
                   int first, int tokens, int h, std::vector<double>* S, std::vector<double>* o) {
  const int DK = k.key_head_dim, DV = k.value_head_dim, kh = h / k.heads_per_key_head;
  for (int t = first; t < first + tokens; ++t) {
    const float* row = &conv[static_cast<size_t>(t) * sh.row_floats];
    const float* q = row + sh.q_at + kh * DK;
    const float* kk = row + sh.k_at + kh * DK;
    const float* v = row + sh.v_at + h * DV;
    const double b = beta[static_cast<size_t>(t) * k.num_heads + h];
    for (int a = 0; a < DK; ++a) {
      const double g = k.form == DeltaRuleDecay::kPerHead
                           ? decay[static_cast<size_t>(t) * k.num_heads + h]
                           : std::exp(static_cast<double>(
                                 decay[(static_cast<size_t>(t) * k.num_heads + h) * DK + a]));
      for (int e = 0; e < DV; ++e) (*S)[a * DV + e] *= g;
    }
    for (int e = 0; e < DV; ++e) {
      double kv = 0;
      for (int a = 0; a < DK; ++a) kv += (*S)[a * DV + e] * kk[a];
      const double delta = (v[e] - kv) * b;
      double out = 0;
      for (int a = 0; a < DK; ++a) {
        (*S)[a * DV + e] += kk[a] * delta;
        out += (*S)[a * DV + e] * q[a];
      }
      o->push_back(out);
    }
  }
}

// Chunks of `lengths` tokens (the last one writing the row it reads) of each case against the
// formula.
void CheckAgainstTheFormula(const std::vector<Case>& cases, const std::vector<int>& lengths, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (const Case& k : cases) {
    const int NH = k.num_heads, NK = NH / k.heads_per_key_head, DK = k.key_head_dim,
              DV = k.value_head_dim;
    DeltaRuleShape sh;
    sh.num_heads = NH;
    sh.heads_per_key_head = k.heads_per_key_head;
    sh.key_head_dim = DK;
    sh.value_head_dim = DV;
    sh.q_at = 3;  // an offset, as a conv state or another tensor before q would give
    sh.k_at = sh.q_at + NK * DK;
    sh.v_at = sh.k_at + NK * DK;
    sh.row_floats = sh.v_at + NH * DV + 5;
    sh.state_at = 11;
    ASSERT_TRUE(CheckDeltaRuleShape(sh).ok());
    int T = 0;
    for (int n : lengths) T += n;
    // q and k of unit length (q scaled), as the norms leave them.
    std::vector<float> conv = Random(static_cast<size_t>(T) * sh.row_floats, rng);
    for (int t = 0; t < T; ++t) {
      for (int g = 0; g < NK; ++g) {
        for (const int at : {sh.q_at, sh.k_at}) {
          float* x = &conv[static_cast<size_t>(t) * sh.row_floats + at + g * DK];
          double ss = 0;
          for (int a = 0; a < DK; ++a) ss += x[a] * x[a];
          const double scale = (at == sh.q_at ? 1.0 / std::sqrt(DK) : 1.0) / std::sqrt(ss);
          for (int a = 0; a < DK; ++a) x[a] = static_cast<float>(x[a] * scale);
        }
      }
    }
    std::vector<float> beta(static_cast<size_t>(T) * NH), decay;
    for (float& b : beta) b = unit(rng);
    if (k.form == DeltaRuleDecay::kPerHead) {
      decay.resize(static_cast<size_t>(T) * NH);
      for (float& g : decay) g = 1.0f - 0.5f * unit(rng) * unit(rng);
    } else {
      decay.resize(static_cast<size_t>(T) * NH * DK);
      for (float& g : decay) g = -5.0f * unit(rng) * unit(rng);
    }
    const int chunks = static_cast<int>(lengths.size());
    const int64_t row_floats = sh.state_at + static_cast<int64_t>(NH) * DK * DV + 7;
    std::vector<float> store = Random(static_cast<size_t>(2 * chunks) * row_floats, rng, 0.5f);
    std::vector<int32_t> chunk_of, table;
    int first = 0;
    for (int c = 0; c < chunks; ++c) {
      const int write = c == chunks - 1 ? 2 * c : 2 * c + 1;
      table.insert(table.end(), {first, lengths[c], 2 * c, write, /*kept states=*/1, /*slot row=*/2 * c});
      for (int j = 0; j < lengths[c]; ++j) chunk_of.push_back(c);
      first += lengths[c];
    }
    DeviceArray<float> d_conv = ToDevice(conv), d_beta = ToDevice(beta), d_decay = ToDevice(decay),
                       d_store = ToDevice(store), d_core;
    DeviceArray<int32_t> d_chunk_of = ToDevice(chunk_of), d_table = ToDevice(table);
    const size_t core_floats = static_cast<size_t>(T) * NH * DV;
    ASSERT_TRUE(d_core.Reserve(core_floats).ok());
    const RecurrentChunks rc{d_chunk_of.get(), d_table.get(), d_store.get(), row_floats};
    ASSERT_TRUE(DeltaRuleRecurrence(d_conv.get(), d_beta.get(), d_decay.get(), k.form, sh, rc, 0,
                                    chunks, d_core.get(), nullptr)
                    .ok());
    const std::vector<float> core = ToHost(d_core, core_floats);
    const std::vector<float> got_store = ToHost(d_store, store.size());
    for (int c = 0; c < chunks; ++c) {
      const int f = table[c * kRecurrentChunkInts], n = lengths[c];
      const int write = table[c * kRecurrentChunkInts + 3];
      std::vector<float> want_o, got_o, want_s, got_s;
      for (int h = 0; h < NH; ++h) {
        const size_t head = sh.state_at + static_cast<size_t>(h) * DK * DV;
        const float* s0 = &store[static_cast<size_t>(2 * c) * row_floats + head];
        std::vector<double> S(s0, s0 + DK * DV), o;
        ReferenceHead(conv, beta, decay, k, sh, f, n, h, &S, &o);
        want_o.insert(want_o.end(), o.begin(), o.end());
        want_s.insert(want_s.end(), S.begin(), S.end());
        for (int t = f; t < f + n; ++t) {
          const float* g = &core[(static_cast<size_t>(t) * NH + h) * DV];
          got_o.insert(got_o.end(), g, g + DV);
        }
        const float* g = &got_store[static_cast<size_t>(write) * row_floats + head];
        got_s.insert(got_s.end(), g, g + DK * DV);
      }
      const double out_rel = n > 0 ? RelativeError(got_o, want_o) : 0.0;
      const double state_rel = RelativeError(got_s, want_s);
      std::printf("delta rule %s heads %d/%d DK %d DV %d chunk %d: out rel %.2e state rel %.2e\n",
                  k.form == DeltaRuleDecay::kPerHead ? "per-head" : "per-channel", NH, NK, DK, DV, n,
                  out_rel, state_rel);
      // fp32 against double: 1e-5, and 3e-5 over a 1024-token chunk (its roundings add up over
      // channels whose decay stays near 1).
      const double bound = n > 130 ? 3e-5 : 1e-5;
      EXPECT_LT(out_rel, bound) << "chunk " << c;
      EXPECT_LT(state_rel, bound) << "chunk " << c;
    }
  }
}

TEST(DeltaRuleKernelTest, MatchesTheFormulaInBothDecayForms) {
  REQUIRE_GPU();
  CheckAgainstTheFormula({Case{4, 2, 16, 24, DeltaRuleDecay::kPerHead}, Case{4, 2, 64, 96, DeltaRuleDecay::kPerHead},
                          Case{2, 1, 128, 160, DeltaRuleDecay::kPerHead},
                          Case{3, 1, 40, 40, DeltaRuleDecay::kPerKeyChannelLog},
                          Case{2, 1, 128, 128, DeltaRuleDecay::kPerKeyChannelLog}},
                         {1, 0, 7, 8, 9, 33, 64, 1}, 41);
}

// A prefill's chunk (1024 tokens, a 2-token one beside it writing its read row) in both forms at
// the released models' head dims (apart: the sanitizers skip it).
TEST(DeltaRuleKernelTest, MatchesTheFormulaOverAPrefillChunk) {
  REQUIRE_GPU();
  CheckAgainstTheFormula({Case{2, 1, 128, 160, DeltaRuleDecay::kPerHead},
                          Case{2, 1, 128, 128, DeltaRuleDecay::kPerKeyChannelLog}},
                         {1024, 2}, 43);
}

// A verify chunk (speculative decoding, engine/cuda/recurrent_chunks.h) of 5 tokens keeping 5
// states in a slot of 6 copies whose copy 2 it reads: kept state k lands in copy k (k < 2) or k + 1,
// and equals, bit for bit, the state a chunk of only its first k + 1 tokens writes (the kernel runs
// every chunk token by token, S in registers); its outputs equal that chunk's; the row it reads is
// left as it was.
TEST(DeltaRuleKernelTest, AVerifyChunkKeepsTheStateAfterEachKeptTokenBitForBit) {
  REQUIRE_GPU();
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  constexpr int kTokens = 5, kCopies = kTokens + 1, kReadCopy = 2;
  for (const Case& k : {Case{4, 2, 64, 96, DeltaRuleDecay::kPerHead},
                        Case{2, 1, 128, 128, DeltaRuleDecay::kPerKeyChannelLog}}) {
    const int NH = k.num_heads, NK = NH / k.heads_per_key_head, DK = k.key_head_dim, DV = k.value_head_dim;
    DeltaRuleShape sh;
    sh.num_heads = NH;
    sh.heads_per_key_head = k.heads_per_key_head;
    sh.key_head_dim = DK;
    sh.value_head_dim = DV;
    sh.q_at = 0;
    sh.k_at = NK * DK;
    sh.v_at = 2 * NK * DK;
    sh.row_floats = sh.v_at + NH * DV;
    sh.state_at = 5;
    std::vector<float> conv = Random(static_cast<size_t>(kTokens) * sh.row_floats, rng, 0.2f);
    std::vector<float> beta(static_cast<size_t>(kTokens) * NH), decay;
    for (float& b : beta) b = unit(rng);
    if (k.form == DeltaRuleDecay::kPerHead) {
      decay.resize(static_cast<size_t>(kTokens) * NH);
      for (float& g : decay) g = 1.0f - 0.5f * unit(rng);
    } else {
      decay.resize(static_cast<size_t>(kTokens) * NH * DK);
      for (float& g : decay) g = -2.0f * unit(rng);
    }
    // Rows 0 .. 5: the slot's copies; rows 6 .. 10: where the references write.
    const int64_t row_floats = sh.state_at + static_cast<int64_t>(NH) * DK * DV;
    const std::vector<float> store = Random(static_cast<size_t>(kCopies + kTokens) * row_floats, rng, 0.5f);
    DeviceArray<float> d_conv = ToDevice(conv), d_beta = ToDevice(beta), d_decay = ToDevice(decay),
                       d_store = ToDevice(store), d_core, d_ref_core;
    const size_t core_floats = static_cast<size_t>(kTokens) * NH * DV;
    ASSERT_TRUE(d_core.Reserve(core_floats).ok());
    ASSERT_TRUE(d_ref_core.Reserve(core_floats).ok());
    const std::vector<int32_t> chunk_of(kTokens, 0);
    DeviceArray<int32_t> d_chunk_of = ToDevice(chunk_of);
    auto run = [&](const std::vector<int32_t>& table, float* core) {
      DeviceArray<int32_t> d_table = ToDevice(table);
      const RecurrentChunks rc{d_chunk_of.get(), d_table.get(), d_store.get(), row_floats,
                               /*max_kept_states=*/table[4]};
      ASSERT_TRUE(DeltaRuleRecurrence(d_conv.get(), d_beta.get(), d_decay.get(), k.form, sh, rc, 0, 1, core, nullptr)
                      .ok());
      ASSERT_EQ(ToHost(d_chunk_of, 1).size(), 1u);  // waits for the launch
    };
    const int32_t last_row = KeptStateRow(0, kReadCopy, kTokens - 1);
    ASSERT_EQ(last_row, kTokens);
    run({0, kTokens, kReadCopy, last_row, kTokens, 0}, d_core.get());
    const std::vector<float> verify_core = ToHost(d_core, core_floats);
    for (int a = 0; a < kTokens; ++a) {
      run({0, a + 1, kReadCopy, kCopies + a, 1, kCopies + a}, d_ref_core.get());
      const std::vector<float> ref_core = ToHost(d_ref_core, core_floats);
      EXPECT_EQ(std::memcmp(ref_core.data(), verify_core.data(), static_cast<size_t>(a + 1) * NH * DV * sizeof(float)),
                0)
          << "outputs of the first " << a + 1 << " tokens";
    }
    const std::vector<float> got = ToHost(d_store, store.size());
    auto row = [&](int r) {
      return std::vector<float>(got.begin() + r * row_floats + sh.state_at, got.begin() + (r + 1) * row_floats);
    };
    for (int a = 0; a < kTokens; ++a) {
      const int kept_row = KeptStateRow(0, kReadCopy, a);
      EXPECT_NE(kept_row, kReadCopy);
      const std::vector<float> kept = row(kept_row), want = row(kCopies + a);
      const bool equal = std::memcmp(kept.data(), want.data(), kept.size() * sizeof(float)) == 0;
      std::printf("delta rule %s verify chunk: kept state %d (row %d) %s the chunk of %d tokens'\n",
                  k.form == DeltaRuleDecay::kPerHead ? "per-head" : "per-channel", a, kept_row,
                  equal ? "bit-equal to" : "DIFFERS from", a + 1);
      EXPECT_TRUE(equal) << "kept state " << a;
    }
    EXPECT_TRUE(std::equal(got.begin() + kReadCopy * row_floats, got.begin() + (kReadCopy + 1) * row_floats,
                           store.begin() + kReadCopy * row_floats))
        << "the row read was written";
  }
}

TEST(DeltaRuleKernelTest, RefusesKeyDimsAboveTheKernels) {
  DeltaRuleShape sh;
  sh.num_heads = 2;
  sh.key_head_dim = 192;
  sh.value_head_dim = 128;
  EXPECT_EQ(CheckDeltaRuleShape(sh).code(), absl::StatusCode::kUnimplemented);
  sh.key_head_dim = 128;
  sh.heads_per_key_head = 3;
  EXPECT_EQ(CheckDeltaRuleShape(sh).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine::cuda
