// The Kimi delta rule (KDA) of one head, in fp32, in the two forms transformers 5.25 computes it
// (models/glm5_next: recurrent_kimi_delta_attention for a decode token,
// chunk_kimi_delta_attention for a prompt or a multi-token continuation). Per token t, with
// q already L2-normalised and scaled by head_dim^-1/2, k L2-normalised, the per-channel
// log-decay g[t] (≤ 0) and β[t]:
//
//   S ← diag(exp(g[t])) · S                      S [key_dim, value_dim], row c decays alone
//   S ← S + k[t] ⊗ β[t] (v[t] − Sᵀk[t])
//   o[t] = Sᵀ q[t]
//
// KdaRecurrent runs that token by token. KdaChunked gives the same outputs and final state (up to
// fp32 rounding) by chunks of `chunk_size` tokens: within a chunk the cumulative decays G, the
// lower-triangular system (I − A) of the keys' mutual effect solved by forward substitution (the
// WY form), the pseudo-values u = (I − A)⁻¹ β v and decayed keys w = (I − A)⁻¹ β k exp(G), then
// v' = u − w S, o = (q exp(G)) S + L v' with L[i][j] = Σ_c q_i[c] k_j[c] exp(G_i[c] − G_j[c])
// for j ≤ i (0 above the diagonal), and S carried to the next chunk as
// diag(exp(G_last)) S + Σᵢ (k_i exp(G_last − G_i)) ⊗ v'_i. A last chunk shorter than chunk_size
// is computed at its own length (transformers pads it with tokens that change nothing).
#pragma once

namespace exl3::engine {

// One head's inputs over T consecutive tokens, row-major with the given strides (in floats)
// between tokens: q, k, g [T][key_dim], v [T][value_dim], beta [T].
struct KdaHeadInputs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
  int qk_stride = 0;    // between consecutive tokens' q and k
  int g_stride = 0;     // between consecutive tokens' g
  int v_stride = 0;     // between consecutive tokens' v
  int beta_stride = 1;  // between consecutive tokens' β
  int key_dim = 0;
  int value_dim = 0;
};

// state [key_dim][value_dim] (in: before the first token, out: after the last); out row t at
// out + t * out_stride, value_dim floats.
void KdaRecurrent(const KdaHeadInputs& in, int num_tokens, float* state, float* out, int out_stride);
void KdaChunked(const KdaHeadInputs& in, int num_tokens, int chunk_size, float* state, float* out,
                int out_stride);

}  // namespace exl3::engine
