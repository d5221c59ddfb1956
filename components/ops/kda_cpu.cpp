// Chunked KDA for the CPU, one (batch, head) pair at a time: the intra-chunk products, the UT solve and the
// state hand-off of a chunk all run on small buffers that stay in the core's cache, where the batched PyTorch
// form (components/ops/kda.py, _ChunkKDA) makes a full pass over memory for every step of the algorithm.
// Same equations as that form (docs/k3.md §2.5) with the pairwise decays always factorised about the middle
// of each chunk's log-decay range (m = G_C / 2); the caller picks a chunk size whose spans allow that.
// The backward keeps only the states entering each chunk and recomputes the intra-chunk quantities.
//
// Layouts: q, k [B, T, H, K] and v [B, T, H, V] in one dtype (bf16, fp32 or fp64); g [B, T, H, K] and
// beta [B, T, H] in the compute dtype (fp32, or fp64 for exact checks); states [B, H, N + 1, K, V].
// keep [B, N] (optional): 0 where a document starts at chunk n (the state entering it is dropped).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

extern "C" {
// BLAS as libtorch_cpu exports it (column-major, 32-bit sizes)
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace {

void blas(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
          float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

void blas(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
          int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C; lda/ldb/ldc are row strides of the stored matrices.
// A row-major matrix is its column-major transpose, so C^T = op(B)^T op(A)^T with the operands swapped.
template <typename T>
inline void mm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
               T* C, int ldc) {
  blas(tb ? 'T' : 'N', ta ? 'T' : 'N', N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}

template <typename T>
struct Shape {
  int64_t B, T_len, H, K, V, C, N;
};

// Per-thread buffers of one chunk (C rows).
template <typename T>
struct Work {
  std::vector<T> q, k, v, G, bt, m, eh, gam, em, Qm, Kbm, ki, A, L, Tm, qg, kgb, kd, bv, W, U, O;
  // backward only
  std::vector<T> dO, dU, dR, dA, dL, dQm, dKbm, dki, tmp, dSn, dSp, dG;
  Work(int64_t C, int64_t K, int64_t V, bool backward)
      : q(C * K), k(C * K), v(C * V), G(C * K), bt(C), m(K), eh(K), gam(K), em(C * K), Qm(C * K), Kbm(C * K),
        ki(C * K), A(C * C), L(C * C), Tm(C * C), qg(C * K), kgb(C * K), kd(C * K), bv(C * V), W(C * K),
        U(C * V), O(C * V) {
    if (backward) {
      for (auto* b : {&dO, &dU, &dR, &tmp}) b->resize(C * std::max(K, V));
      for (auto* b : {&dA, &dL}) b->resize(C * C);
      for (auto* b : {&dQm, &dKbm, &dki, &dG}) b->resize(C * K);
      dSn.resize(K * V);
      dSp.resize(K * V);
    }
  }
};

// rows [t0, t0 + rows) of head h of batch b from a [B, T, H, D] tensor into dst [C, D] (zeros below)
template <typename T, typename in_t>
void load_rows(T* dst, const in_t* src, const Shape<T>& s, int64_t b, int64_t h, int64_t t0, int64_t rows,
               int64_t D) {
  for (int64_t r = 0; r < s.C; ++r) {
    T* out = dst + r * D;
    if (r < rows) {
      const in_t* row = src + ((b * s.T_len + t0 + r) * s.H + h) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(row[d]);
    } else {
      std::fill(out, out + D, T(0));
    }
  }
}

template <typename T, typename out_t>
void store_rows(out_t* dst, const T* src, const Shape<T>& s, int64_t b, int64_t h, int64_t t0, int64_t rows,
                int64_t D, T scale) {
  for (int64_t r = 0; r < rows; ++r) {
    out_t* row = dst + ((b * s.T_len + t0 + r) * s.H + h) * D;
    const T* in = src + r * D;
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<out_t>(in[d] * scale);
  }
}

// The intra-chunk quantities of chunk n of pair (b, h), U = Tm (beta v) - W S for entering state S:
// everything the output, the hand-off and the backward need.
template <typename T, typename in_t>
int64_t intra_chunk(Work<T>& w, const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta,
                    const T* S, const Shape<T>& s, int64_t b, int64_t h, int64_t n) {
  const int64_t C = s.C, K = s.K, V = s.V;
  const int64_t t0 = n * C, rows = std::min(C, s.T_len - t0);
  load_rows(w.q.data(), q, s, b, h, t0, rows, K);
  load_rows(w.k.data(), k, s, b, h, t0, rows, K);
  load_rows(w.v.data(), v, s, b, h, t0, rows, V);
  load_rows(w.G.data(), g, s, b, h, t0, rows, K);
  for (int64_t r = 0; r < C; ++r) w.bt[r] = r < rows ? beta[(b * s.T_len + t0 + r) * s.H + h] : T(0);
  // in-chunk inclusive cumsum of g; padded rows have g = 0, so G stays flat there
  for (int64_t r = 1; r < C; ++r)
    for (int64_t d = 0; d < K; ++d) w.G[r * K + d] += w.G[(r - 1) * K + d];
  for (int64_t d = 0; d < K; ++d) {
    w.m[d] = T(0.5) * w.G[(C - 1) * K + d];  // middle of the chunk's log-decay range
    w.eh[d] = std::exp(w.m[d]);              // exp(G_C - m)
    w.gam[d] = w.eh[d] * w.eh[d];            // exp(G_C)
  }
  for (int64_t r = 0; r < C; ++r) {
    const T bt = w.bt[r];
    for (int64_t d = 0; d < K; ++d) {
      const int64_t i = r * K + d;
      const T em = std::exp(w.G[i] - w.m[d]);  // exp(G - m), within exp(+-span / 2)
      w.em[i] = em;
      w.Qm[i] = w.q[i] * em;
      w.Kbm[i] = bt * w.k[i] * em;
      w.ki[i] = w.k[i] / em;  // k exp(m - G)
      w.qg[i] = w.Qm[i] * w.eh[d];
      w.kgb[i] = w.Kbm[i] * w.eh[d];
      w.kd[i] = w.ki[i] * w.eh[d];  // k exp(G_C - G)
    }
    for (int64_t d = 0; d < V; ++d) w.bv[r * V + d] = bt * w.v[r * V + d];
  }
  // A = [q_r . exp(G_r - G_c) k_c]_{c <= r}, L the same for beta k rows, c < r
  mm<T>(false, true, C, C, K, 1, w.Qm.data(), K, w.ki.data(), K, 0, w.A.data(), C);
  mm<T>(false, true, C, C, K, 1, w.Kbm.data(), K, w.ki.data(), K, 0, w.L.data(), C);
  for (int64_t r = 0; r < C; ++r) {
    std::fill(w.A.data() + r * C + r + 1, w.A.data() + (r + 1) * C, T(0));
    std::fill(w.L.data() + r * C + r, w.L.data() + (r + 1) * C, T(0));
  }
  // Tm = (I + L)^-1 by forward substitution: row r = e_r - sum_{c < r} L[r, c] Tm[c]
  T* Tm = w.Tm.data();
  std::fill(Tm, Tm + C * C, T(0));
  for (int64_t r = 0; r < C; ++r) {
    T* row = Tm + r * C;
    row[r] = T(1);
    for (int64_t c = 0; c < r; ++c) {
      const T coef = -w.L[r * C + c];
      if (coef == T(0)) continue;
      const T* prev = Tm + c * C;
      for (int64_t j = 0; j <= c; ++j) row[j] += coef * prev[j];
    }
  }
  // W = Tm (beta exp(G) k), U = Tm (beta v) - W S
  mm<T>(false, false, C, K, C, 1, Tm, C, w.kgb.data(), K, 0, w.W.data(), K);
  mm<T>(false, false, C, V, C, 1, Tm, C, w.bv.data(), V, 0, w.U.data(), V);
  mm<T>(false, false, C, V, K, -1, w.W.data(), K, S, V, 1, w.U.data(), V);
  return rows;
}

template <typename T, typename in_t>
void forward_impl(const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta, const T* init,
                  const T* keep, in_t* o, T* states, const Shape<T>& s, T scale) {
  const int64_t C = s.C, K = s.K, V = s.V, N = s.N, KV = K * V;
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    Work<T> w(C, K, V, false);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / s.H, h = pair % s.H;
      T* S = states + pair * (N + 1) * KV;  // S[n]: the state entering chunk n; S[N]: the final state
      if (init != nullptr) {
        std::copy(init + pair * KV, init + (pair + 1) * KV, S);
      } else {
        std::fill(S, S + KV, T(0));
      }
      if (keep != nullptr && keep[b * N] == T(0)) std::fill(S, S + KV, T(0));
      for (int64_t n = 0; n < N; ++n) {
        const T* Sn = S + n * KV;
        T* Snext = S + (n + 1) * KV;
        const int64_t rows = intra_chunk(w, q, k, v, g, beta, Sn, s, b, h, n);
        // O = (exp(G) q) S + A U
        mm<T>(false, false, C, V, K, 1, w.qg.data(), K, Sn, V, 0, w.O.data(), V);
        mm<T>(false, false, C, V, C, 1, w.A.data(), C, w.U.data(), V, 1, w.O.data(), V);
        store_rows(o, w.O.data(), s, b, h, n * C, rows, V, scale);
        // S' = exp(G_C) S + (exp(G_C - G) k)^T U
        for (int64_t d = 0; d < K; ++d)
          for (int64_t e = 0; e < V; ++e) Snext[d * V + e] = w.gam[d] * Sn[d * V + e];
        mm<T>(true, false, K, V, C, 1, w.kd.data(), K, w.U.data(), V, 1, Snext, V);
        // the final state is never reset
        if (keep != nullptr && n + 1 < N && keep[b * N + n + 1] == T(0)) std::fill(Snext, Snext + KV, T(0));
      }
    }
  });
}

template <typename T, typename in_t>
void backward_impl(const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta, const T* keep,
                   const T* states, const in_t* dout, const T* dfinal, in_t* dq, in_t* dk, in_t* dv, T* dg,
                   T* dbeta, T* dinit, const Shape<T>& s, T scale) {
  const int64_t C = s.C, K = s.K, V = s.V, N = s.N, KV = K * V;
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    Work<T> w(C, K, V, true);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / s.H, h = pair % s.H;
      const T* S = states + pair * (N + 1) * KV;
      T* dSn = w.dSn.data();  // grad of the state leaving the current chunk
      if (dfinal != nullptr) {
        std::copy(dfinal + pair * KV, dfinal + (pair + 1) * KV, dSn);
      } else {
        std::fill(dSn, dSn + KV, T(0));
      }
      for (int64_t n = N - 1; n >= 0; --n) {
        const T* Sn = S + n * KV;
        const T* Snext = S + (n + 1) * KV;
        const int64_t rows = intra_chunk(w, q, k, v, g, beta, Sn, s, b, h, n);
        const int64_t t0 = n * C;
        load_rows(w.dO.data(), dout, s, b, h, t0, rows, V);
        for (int64_t i = 0; i < C * V; ++i) w.dO[i] *= scale;
        // dU = A^T dO + kd dS'
        mm<T>(true, false, C, V, C, 1, w.A.data(), C, w.dO.data(), V, 0, w.dU.data(), V);
        mm<T>(false, false, C, V, K, 1, w.kd.data(), K, dSn, V, 1, w.dU.data(), V);
        // dS = qg^T dO + exp(G_C) dS' - W^T dU: the grad of the state entering this chunk
        T* dSp = w.dSp.data();
        mm<T>(true, false, K, V, C, 1, w.qg.data(), K, w.dO.data(), V, 0, dSp, V);
        for (int64_t d = 0; d < K; ++d)
          for (int64_t e = 0; e < V; ++e) dSp[d * V + e] += w.gam[d] * dSn[d * V + e];
        mm<T>(true, false, K, V, C, -1, w.W.data(), K, w.dU.data(), V, 1, dSp, V);
        // U = Tm R with R = beta v - kgb S: dR = Tm^T dU
        mm<T>(true, false, C, V, C, 1, w.Tm.data(), C, w.dU.data(), V, 0, w.dR.data(), V);
        // dA = dO U^T (c <= r), dL = -dR U^T (c < r)
        mm<T>(false, true, C, C, V, 1, w.dO.data(), V, w.U.data(), V, 0, w.dA.data(), C);
        mm<T>(false, true, C, C, V, -1, w.dR.data(), V, w.U.data(), V, 0, w.dL.data(), C);
        for (int64_t r = 0; r < C; ++r) {
          std::fill(w.dA.data() + r * C + r + 1, w.dA.data() + (r + 1) * C, T(0));
          std::fill(w.dL.data() + r * C + r, w.dL.data() + (r + 1) * C, T(0));
        }
        // grads of the factors Qm = q exp(G - m), Kbm = beta k exp(G - m), ki = k exp(m - G); the state
        // terms qg, kgb, kd are those factors times exp(G_C - m), held fixed (G_C's own term is added below)
        mm<T>(false, false, C, K, C, 1, w.dA.data(), C, w.ki.data(), K, 0, w.dQm.data(), K);
        mm<T>(false, true, C, K, V, 1, w.dO.data(), V, Sn, V, 0, w.tmp.data(), K);
        for (int64_t r = 0; r < C; ++r)
          for (int64_t d = 0; d < K; ++d) w.dQm[r * K + d] += w.tmp[r * K + d] * w.eh[d];
        mm<T>(false, false, C, K, C, 1, w.dL.data(), C, w.ki.data(), K, 0, w.dKbm.data(), K);
        mm<T>(false, true, C, K, V, 1, w.dR.data(), V, Sn, V, 0, w.tmp.data(), K);
        for (int64_t r = 0; r < C; ++r)
          for (int64_t d = 0; d < K; ++d) w.dKbm[r * K + d] -= w.tmp[r * K + d] * w.eh[d];
        mm<T>(true, false, C, K, C, 1, w.dA.data(), C, w.Qm.data(), K, 0, w.dki.data(), K);
        mm<T>(true, false, C, K, C, 1, w.dL.data(), C, w.Kbm.data(), K, 1, w.dki.data(), K);
        mm<T>(false, true, C, K, V, 1, w.U.data(), V, dSn, V, 0, w.tmp.data(), K);
        for (int64_t r = 0; r < C; ++r)
          for (int64_t d = 0; d < K; ++d) w.dki[r * K + d] += w.tmp[r * K + d] * w.eh[d];
        // dG: exp(G - m) on the Qm / Kbm rows, exp(m - G) on ki; S' scales with exp(G_C) as a whole
        for (int64_t i = 0; i < C * K; ++i) w.dG[i] = w.dQm[i] * w.Qm[i] + w.dKbm[i] * w.Kbm[i] - w.dki[i] * w.ki[i];
        for (int64_t d = 0; d < K; ++d) {
          T acc = 0;
          for (int64_t e = 0; e < V; ++e) acc += dSn[d * V + e] * Snext[d * V + e];
          w.dG[(C - 1) * K + d] += acc;
        }
        // G is the inclusive cumsum of g: dg_r = sum_{r' >= r} dG_r'
        for (int64_t r = C - 2; r >= 0; --r)
          for (int64_t d = 0; d < K; ++d) w.dG[r * K + d] += w.dG[(r + 1) * K + d];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t tok = (b * s.T_len + t0 + r) * s.H + h;
          const T bt = w.bt[r];
          T db = 0;
          for (int64_t d = 0; d < K; ++d) {
            const int64_t i = r * K + d;
            const T dbk = w.dKbm[i] * w.em[i];  // grad of beta k
            db += dbk * w.k[i];
            dq[tok * K + d] = static_cast<in_t>(w.dQm[i] * w.em[i]);
            dk[tok * K + d] = static_cast<in_t>(dbk * bt + w.dki[i] / w.em[i]);
            dg[tok * K + d] = w.dG[i];
          }
          for (int64_t e = 0; e < V; ++e) {
            db += w.dR[r * V + e] * w.v[r * V + e];
            dv[tok * V + e] = static_cast<in_t>(bt * w.dR[r * V + e]);
          }
          dbeta[tok] = db;
        }
        // nothing flows through a reset hand-off
        const bool reset = keep != nullptr && keep[b * N + n] == T(0);
        for (int64_t i = 0; i < KV; ++i) dSn[i] = reset ? T(0) : dSp[i];
      }
      if (dinit != nullptr) std::copy(dSn, dSn + KV, dinit + pair * KV);
    }
  });
}

template <typename T>
Shape<T> shape_of(const at::Tensor& q, const at::Tensor& v, int64_t C) {
  Shape<T> s;
  s.B = q.size(0);
  s.T_len = q.size(1);
  s.H = q.size(2);
  s.K = q.size(3);
  s.V = v.size(3);
  s.C = C;
  s.N = (s.T_len + C - 1) / C;
  return s;
}

const float* opt_ptr_f(const c10::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }
const double* opt_ptr_d(const c10::optional<at::Tensor>& t) { return t ? t->data_ptr<double>() : nullptr; }

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t);
template <>
const float* opt_ptr<float>(const c10::optional<at::Tensor>& t) { return opt_ptr_f(t); }
template <>
const double* opt_ptr<double>(const c10::optional<at::Tensor>& t) { return opt_ptr_d(t); }

std::tuple<at::Tensor, at::Tensor> kda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& g, const at::Tensor& beta,
                                               const c10::optional<at::Tensor>& init,
                                               const c10::optional<at::Tensor>& keep, double scale,
                                               int64_t chunk) {
  auto o = at::empty_like(v);
  const int64_t N = (q.size(1) + chunk - 1) / chunk;
  auto states = at::empty({q.size(0), q.size(2), N + 1, q.size(3), v.size(3)}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "kda_forward", [&] {
    using T = scalar_t;
    auto s = shape_of<T>(q, v, chunk);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "kda_forward_in", [&] {
      forward_impl<T, scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                g.data_ptr<T>(), beta.data_ptr<T>(), opt_ptr<T>(init), opt_ptr<T>(keep),
                                o.data_ptr<scalar_t>(), states.data_ptr<T>(), s, static_cast<T>(scale));
    });
  });
  return {o, states};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const c10::optional<at::Tensor>& keep, const at::Tensor& states, const at::Tensor& dout,
    const c10::optional<at::Tensor>& dfinal, bool want_dinit, double scale, int64_t chunk) {
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto dg = at::empty_like(g), dbeta = at::empty_like(beta);
  // a custom op returns tensors, never None: an empty one when the initial state needs no grad
  auto dinit = want_dinit ? at::empty({q.size(0), q.size(2), q.size(3), v.size(3)}, g.options()) : at::empty({0}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "kda_backward", [&] {
    using T = scalar_t;
    auto s = shape_of<T>(q, v, chunk);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "kda_backward_in", [&] {
      backward_impl<T, scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                 g.data_ptr<T>(), beta.data_ptr<T>(), opt_ptr<T>(keep), states.data_ptr<T>(),
                                 dout.data_ptr<scalar_t>(), opt_ptr<T>(dfinal), dq.data_ptr<scalar_t>(),
                                 dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), dg.data_ptr<T>(),
                                 dbeta.data_ptr<T>(), want_dinit ? dinit.data_ptr<T>() : nullptr, s,
                                 static_cast<T>(scale));
    });
  });
  return {dq, dk, dv, dg, dbeta, dinit};
}

// largest total log-decay -sum(g) of any chunk of `chunk` tokens, over every (batch, head, channel)
double max_chunk_span(const at::Tensor& g, int64_t chunk) {
  double best = 0;
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "max_chunk_span", [&] {
    const scalar_t* p = g.data_ptr<scalar_t>();
    const int64_t B = g.size(0), T_len = g.size(1), HK = g.size(2) * g.size(3);
    const int64_t N = (T_len + chunk - 1) / chunk;
    best = at::parallel_reduce(
        0, B * N, 1, 0.0,
        [&](int64_t begin, int64_t end, double acc) {
          std::vector<double> sum(HK);
          for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / N, t0 = (i % N) * chunk, t1 = std::min(T_len, t0 + chunk);
            std::fill(sum.begin(), sum.end(), 0.0);
            for (int64_t t = t0; t < t1; ++t) {
              const scalar_t* row = p + (b * T_len + t) * HK;
              for (int64_t j = 0; j < HK; ++j) sum[j] += row[j];
            }
            for (int64_t j = 0; j < HK; ++j) acc = std::max(acc, -sum[j]);
          }
          return acc;
        },
        [](double a, double b) { return std::max(a, b); });
  });
  return best;
}

}  // namespace

TORCH_LIBRARY(k3_kda_cpu, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? init, Tensor? keep, float scale, "
        "int chunk) -> (Tensor, Tensor)");
  m.def("backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? keep, Tensor states, Tensor dout, "
        "Tensor? dfinal, bool want_dinit, float scale, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def("max_chunk_span(Tensor g, int chunk) -> float");
}

TORCH_LIBRARY_IMPL(k3_kda_cpu, CPU, m) {
  m.impl("forward", &kda_forward);
  m.impl("backward", &kda_backward);
  m.impl("max_chunk_span", &max_chunk_span);
}
