#include "engine/cpu/linear_attention/kimi_delta_rule.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace exl3::engine {

void KdaRecurrent(const KdaHeadInputs& in, int T, float* S, float* out, int out_stride) {
  const int DK = in.key_dim, DV = in.value_dim;
  std::vector<float> delta(DV);
  for (int t = 0; t < T; ++t) {
    const float* q = in.q + static_cast<size_t>(t) * in.qk_stride;
    const float* k = in.k + static_cast<size_t>(t) * in.qk_stride;
    const float* g = in.g + static_cast<size_t>(t) * in.g_stride;
    const float* v = in.v + static_cast<size_t>(t) * in.v_stride;
    const float b = in.beta[static_cast<size_t>(t) * in.beta_stride];
    std::fill(delta.begin(), delta.end(), 0.0f);
    for (int c = 0; c < DK; ++c) {
      float* Sc = S + static_cast<size_t>(c) * DV;
      const float decay = std::exp(g[c]);
      for (int e = 0; e < DV; ++e) {
        Sc[e] *= decay;
        delta[e] += Sc[e] * k[c];  // (Sᵀk)[e]
      }
    }
    for (int e = 0; e < DV; ++e) delta[e] = (v[e] - delta[e]) * b;
    float* o = out + static_cast<size_t>(t) * out_stride;
    std::fill_n(o, DV, 0.0f);
    for (int c = 0; c < DK; ++c) {
      float* Sc = S + static_cast<size_t>(c) * DV;
      for (int e = 0; e < DV; ++e) {
        Sc[e] += k[c] * delta[e];
        o[e] += Sc[e] * q[c];
      }
    }
  }
}

void KdaChunked(const KdaHeadInputs& in, int T, int chunk_size, float* S, float* out, int out_stride) {
  const int DK = in.key_dim, DV = in.value_dim;
  std::vector<float> G, A, Aqk, u, w, vnew, qS;
  for (int start = 0; start < T; start += chunk_size) {
    const int C = std::min(chunk_size, T - start);
    auto q = [&](int i) { return in.q + static_cast<size_t>(start + i) * in.qk_stride; };
    auto k = [&](int i) { return in.k + static_cast<size_t>(start + i) * in.qk_stride; };
    auto v = [&](int i) { return in.v + static_cast<size_t>(start + i) * in.v_stride; };
    auto beta = [&](int i) { return in.beta[static_cast<size_t>(start + i) * in.beta_stride]; };
    // G[i][c]: the log-decay summed over the chunk's tokens 0..i.
    G.assign(static_cast<size_t>(C) * DK, 0.0f);
    for (int i = 0; i < C; ++i) {
      const float* g = in.g + static_cast<size_t>(start + i) * in.g_stride;
      for (int c = 0; c < DK; ++c) G[i * DK + c] = (i > 0 ? G[(i - 1) * DK + c] : 0.0f) + g[c];
    }
    // A[i][j] (j < i) = −β_i Σ_c k_i[c] k_j[c] exp(G_i[c] − G_j[c]); Aqk[i][j] (j ≤ i) the same
    // with q_i for β_i k_i.
    A.assign(static_cast<size_t>(C) * C, 0.0f);
    Aqk.assign(static_cast<size_t>(C) * C, 0.0f);
    for (int i = 0; i < C; ++i) {
      for (int j = 0; j <= i; ++j) {
        float kk = 0.0f, qk = 0.0f;
        for (int c = 0; c < DK; ++c) {
          const float d = std::exp(G[i * DK + c] - G[j * DK + c]);
          kk += k(i)[c] * k(j)[c] * d;
          qk += q(i)[c] * k(j)[c] * d;
        }
        if (j < i) A[i * C + j] = -beta(i) * kk;
        Aqk[i * C + j] = qk;
      }
    }
    // Forward substitution, row by row: row i gains Σ_m A[i][m] · (solved row m); then + I.
    for (int i = 1; i < C; ++i) {
      std::vector<float> row(A.begin() + static_cast<size_t>(i) * C, A.begin() + static_cast<size_t>(i) * C + i);
      for (int j = 0; j < i; ++j) {
        float acc = row[j];
        for (int m = j + 1; m < i; ++m) acc += row[m] * A[m * C + j];
        A[i * C + j] = acc;
      }
    }
    for (int i = 0; i < C; ++i) A[i * C + i] = 1.0f;
    // u = A (β v), w = A (β k exp(G)).
    u.assign(static_cast<size_t>(C) * DV, 0.0f);
    w.assign(static_cast<size_t>(C) * DK, 0.0f);
    for (int i = 0; i < C; ++i) {
      for (int j = 0; j <= i; ++j) {
        const float a = A[i * C + j] * beta(j);
        if (a == 0.0f) continue;
        for (int e = 0; e < DV; ++e) u[i * DV + e] += a * v(j)[e];
        for (int c = 0; c < DK; ++c) w[i * DK + c] += a * k(j)[c] * std::exp(G[j * DK + c]);
      }
    }
    // v' = u − w S; o = (q exp(G)) S + Aqk v'.
    vnew.assign(static_cast<size_t>(C) * DV, 0.0f);
    for (int i = 0; i < C; ++i) {
      float* o = out + static_cast<size_t>(start + i) * out_stride;
      std::fill_n(o, DV, 0.0f);
      for (int c = 0; c < DK; ++c) {
        const float* Sc = S + static_cast<size_t>(c) * DV;
        const float wc = w[i * DK + c], qc = q(i)[c] * std::exp(G[i * DK + c]);
        for (int e = 0; e < DV; ++e) {
          vnew[i * DV + e] -= wc * Sc[e];
          o[e] += qc * Sc[e];
        }
      }
      for (int e = 0; e < DV; ++e) vnew[i * DV + e] += u[i * DV + e];
    }
    for (int i = 0; i < C; ++i) {
      float* o = out + static_cast<size_t>(start + i) * out_stride;
      for (int j = 0; j <= i; ++j) {
        const float a = Aqk[i * C + j];
        for (int e = 0; e < DV; ++e) o[e] += a * vnew[j * DV + e];
      }
    }
    // S ← diag(exp(G_last)) S + Σ_i (k_i exp(G_last − G_i)) ⊗ v'_i.
    const float* last = &G[static_cast<size_t>(C - 1) * DK];
    for (int c = 0; c < DK; ++c) {
      float* Sc = S + static_cast<size_t>(c) * DV;
      const float decay = std::exp(last[c]);
      for (int e = 0; e < DV; ++e) Sc[e] *= decay;
      for (int i = 0; i < C; ++i) {
        const float kc = k(i)[c] * std::exp(last[c] - G[i * DK + c]);
        for (int e = 0; e < DV; ++e) Sc[e] += kc * vnew[i * DV + e];
      }
    }
  }
}

}  // namespace exl3::engine
