// engine/cpu/linear_attention/kimi_delta_rule: the recurrent and chunked forms of KDA against a straightforward
// double-precision recurrence and against each other, on random inputs: chunk edges inside the
// run, a short last chunk, a non-zero starting state, and a run split in two with the state
// carried over.
#include "engine/cpu/linear_attention/kimi_delta_rule.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

struct HeadRun {
  int T, DK, DV;
  std::vector<float> q, k, v, g, beta, state;
};

HeadRun RandomRun(int T, int DK, int DV, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  HeadRun r{T, DK, DV, {}, {}, {}, {}, {}, {}};
  auto normalised = [&](std::vector<float>& x, float scale) {
    x.resize(static_cast<size_t>(T) * DK);
    for (int t = 0; t < T; ++t) {
      double ss = 0.0;
      for (int c = 0; c < DK; ++c) ss += std::pow(x[t * DK + c] = n(rng), 2);
      for (int c = 0; c < DK; ++c) x[t * DK + c] *= static_cast<float>(scale / std::sqrt(ss + 1e-6));
    }
  };
  normalised(r.q, 1.0f / std::sqrt(static_cast<float>(DK)));
  normalised(r.k, 1.0f);
  for (int i = 0; i < T * DV; ++i) r.v.push_back(n(rng));
  // Log-decays of the lower-bound gate: −5 · sigmoid(·), here −5 · U(0, 0.1) and a few large.
  for (int i = 0; i < T * DK; ++i) r.g.push_back(-5.0f * (i % 7 == 0 ? u(rng) : 0.1f * u(rng)));
  for (int t = 0; t < T; ++t) r.beta.push_back(u(rng));
  for (int i = 0; i < DK * DV; ++i) r.state.push_back(0.3f * n(rng));
  return r;
}

KdaHeadInputs Inputs(const HeadRun& r, int first = 0) {
  KdaHeadInputs in;
  in.q = r.q.data() + first * r.DK;
  in.k = r.k.data() + first * r.DK;
  in.g = r.g.data() + first * r.DK;
  in.v = r.v.data() + first * r.DV;
  in.beta = r.beta.data() + first;
  in.qk_stride = r.DK;
  in.g_stride = r.DK;
  in.v_stride = r.DV;
  in.key_dim = r.DK;
  in.value_dim = r.DV;
  return in;
}

// The recurrence as written, in double.
void Reference(const HeadRun& r, std::vector<double>* out, std::vector<double>* state) {
  std::vector<double> S(r.state.begin(), r.state.end());
  out->assign(static_cast<size_t>(r.T) * r.DV, 0.0);
  for (int t = 0; t < r.T; ++t) {
    for (int c = 0; c < r.DK; ++c)
      for (int e = 0; e < r.DV; ++e) S[c * r.DV + e] *= std::exp(static_cast<double>(r.g[t * r.DK + c]));
    for (int e = 0; e < r.DV; ++e) {
      double kv = 0.0;
      for (int c = 0; c < r.DK; ++c) kv += S[c * r.DV + e] * r.k[t * r.DK + c];
      const double delta = r.beta[t] * (r.v[t * r.DV + e] - kv);
      for (int c = 0; c < r.DK; ++c) S[c * r.DV + e] += r.k[t * r.DK + c] * delta;
    }
    for (int e = 0; e < r.DV; ++e) {
      double o = 0.0;
      for (int c = 0; c < r.DK; ++c) o += S[c * r.DV + e] * r.q[t * r.DK + c];
      (*out)[t * r.DV + e] = o;
    }
  }
  *state = S;
}

double MaxRelative(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += std::pow(got[i] - want[i], 2);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST(KimiDeltaRule, RecurrentAndChunkedMatchTheReference) {
  for (int chunk : {1, 4, 8, 64}) {
    const HeadRun r = RandomRun(/*T=*/37, /*DK=*/16, /*DV=*/12, /*seed=*/chunk);
    std::vector<double> want, want_state;
    Reference(r, &want, &want_state);
    std::vector<float> rec_state = r.state, rec(static_cast<size_t>(r.T) * r.DV);
    KdaRecurrent(Inputs(r), r.T, rec_state.data(), rec.data(), r.DV);
    std::vector<float> chk_state = r.state, chk(static_cast<size_t>(r.T) * r.DV);
    KdaChunked(Inputs(r), r.T, chunk, chk_state.data(), chk.data(), r.DV);
    EXPECT_LT(MaxRelative(rec, want), 1e-5) << "recurrent";
    EXPECT_LT(MaxRelative(rec_state, want_state), 1e-5) << "recurrent state";
    EXPECT_LT(MaxRelative(chk, want), 1e-5) << "chunk " << chunk;
    EXPECT_LT(MaxRelative(chk_state, want_state), 1e-5) << "chunk " << chunk << " state";
  }
}

TEST(KimiDeltaRule, StateCarriesOverARunSplitInTwo) {
  const HeadRun r = RandomRun(/*T=*/75, /*DK=*/32, /*DV=*/32, /*seed=*/7);
  std::vector<double> want, want_state;
  Reference(r, &want, &want_state);
  // A prompt of 29 tokens (chunks of 16: an edge inside), 3 decode tokens, then 43 more.
  std::vector<float> S = r.state, out(static_cast<size_t>(r.T) * r.DV);
  KdaChunked(Inputs(r, 0), 29, 16, S.data(), out.data(), r.DV);
  for (int t = 29; t < 32; ++t) KdaRecurrent(Inputs(r, t), 1, S.data(), out.data() + t * r.DV, r.DV);
  KdaChunked(Inputs(r, 32), 43, 16, S.data(), out.data() + 32 * r.DV, r.DV);
  EXPECT_LT(MaxRelative(out, want), 1e-5);
  EXPECT_LT(MaxRelative(S, want_state), 1e-5);
}

TEST(KimiDeltaRule, StridedInputs) {
  // Heads interleaved in one row per token, as the layer lays them out: head 1 of 2.
  const int T = 20, DK = 8, DV = 8, H = 2;
  const HeadRun r = RandomRun(T, DK, DV, 3);
  std::vector<float> q(T * H * DK, 9.0f), k(T * H * DK, 9.0f), g(T * H * DK, 9.0f), v(T * H * DV, 9.0f),
      beta(T * H, 9.0f);
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < DK; ++c) {
      q[(t * H + 1) * DK + c] = r.q[t * DK + c];
      k[(t * H + 1) * DK + c] = r.k[t * DK + c];
      g[(t * H + 1) * DK + c] = r.g[t * DK + c];
    }
    for (int e = 0; e < DV; ++e) v[(t * H + 1) * DV + e] = r.v[t * DV + e];
    beta[t * H + 1] = r.beta[t];
  }
  KdaHeadInputs in;
  in.q = q.data() + DK;
  in.k = k.data() + DK;
  in.v = v.data() + DV;
  in.g = g.data() + DK;
  in.beta = beta.data() + 1;
  in.qk_stride = in.g_stride = H * DK;
  in.v_stride = H * DV;
  in.beta_stride = H;
  in.key_dim = DK;
  in.value_dim = DV;
  std::vector<double> want, want_state;
  Reference(r, &want, &want_state);
  std::vector<float> S = r.state, out(T * H * DV, 0.0f), got(T * DV);
  KdaChunked(in, T, 8, S.data(), out.data() + DV, H * DV);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < DV; ++e) got[t * DV + e] = out[(t * H + 1) * DV + e];
  EXPECT_LT(MaxRelative(got, want), 1e-5);
}

}  // namespace
}  // namespace exl3::engine
