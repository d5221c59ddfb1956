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

// only the ATen headers used: ATen/ATen.h (every operator) adds several seconds to each first-use build
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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

struct Shape {
  int64_t B, T_len, H, K, V, C, N;
};

// Per-thread buffers of one chunk (C rows). Operands that share a product are stacked so that one BLAS call
// serves both: QK = [q exp(G - m); beta k exp(G - m)] against ki gives AL = [A; L], and Tm against
// RHS = [kgb | beta v] gives WU = [W | U].
template <typename T>
struct Work {
  std::vector<T> q, k, v, G, bt, m, eh, gam, em, QK, ki, AL, Tm, qg, kd, RHS, WU, O;
  // backward only: dOR = [dO; dR], dAL = [dA; dL], dQK = [dQm; dKbm]
  std::vector<T> dOR, dU, dAL, dQK, dki, tmp, dSn, dSp, dG;
  Work(int64_t C, int64_t K, int64_t V, bool backward)
      : q(C * K), k(C * K), v(C * V), G(C * K), bt(C), m(K), eh(K), gam(K), em(C * K), QK(2 * C * K), ki(C * K),
        AL(2 * C * C), Tm(C * C), qg(C * K), kd(C * K), RHS(C * (K + V)), WU(C * (K + V)), O(C * V) {
    if (backward) {
      dOR.resize(2 * C * V);
      dU.resize(C * V);
      dAL.resize(2 * C * C);
      dQK.resize(2 * C * K);
      tmp.resize(2 * C * K);
      dki.resize(C * K);
      dG.resize(C * K);
      dSn.resize(K * V);
      dSp.resize(K * V);
    }
  }
};

// rows [t0, t0 + rows) of head h of batch b from a [B, T, H, D] tensor into dst [C, D] (zeros below)
template <typename T, typename in_t>
void load_rows(T* dst, const in_t* src, const Shape& s, int64_t b, int64_t h, int64_t t0, int64_t rows,
               int64_t D) {
  for (int64_t r = 0; r < s.C; ++r) {
    T* out = dst + r * D;
    if (r < rows) {
      const in_t* row = src + ((b * s.T_len + t0 + r) * s.H + h) * D;
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(row[d]);
    } else {
      std::fill(out, out + D, T(0));
    }
  }
}

template <typename T, typename out_t>
void store_rows(out_t* dst, const T* src, const Shape& s, int64_t b, int64_t h, int64_t t0, int64_t rows,
                int64_t D, T scale) {
  for (int64_t r = 0; r < rows; ++r) {
    out_t* row = dst + ((b * s.T_len + t0 + r) * s.H + h) * D;
    const T* in = src + r * D;
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<out_t>(in[d] * scale);
  }
}

// The intra-chunk quantities of chunk n of pair (b, h), with U = Tm (beta v) - W S for entering state S:
// everything the output, the hand-off and the backward need. Returns the chunk's number of real tokens.
template <typename T, typename in_t>
int64_t intra_chunk(Work<T>& w, const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta,
                    const T* S, const Shape& s, int64_t b, int64_t h, int64_t n) {
  const int64_t C = s.C, K = s.K, V = s.V, KV2 = K + V;
  const int64_t t0 = n * C, rows = std::min(C, s.T_len - t0);
  load_rows(w.q.data(), q, s, b, h, t0, rows, K);
  load_rows(w.k.data(), k, s, b, h, t0, rows, K);
  load_rows(w.v.data(), v, s, b, h, t0, rows, V);
  load_rows(w.G.data(), g, s, b, h, t0, rows, K);
  for (int64_t r = 0; r < C; ++r) w.bt[r] = r < rows ? beta[(b * s.T_len + t0 + r) * s.H + h] : T(0);
  // in-chunk inclusive cumsum of g; padded rows have g = 0, so G stays flat there
  for (int64_t r = 1; r < C; ++r)
    #pragma omp simd
    for (int64_t d = 0; d < K; ++d) w.G[r * K + d] += w.G[(r - 1) * K + d];
  for (int64_t d = 0; d < K; ++d) {
    w.m[d] = T(0.5) * w.G[(C - 1) * K + d];  // middle of the chunk's log-decay range
    w.eh[d] = std::exp(w.m[d]);              // exp(G_C - m)
    w.gam[d] = w.eh[d] * w.eh[d];            // exp(G_C)
  }
  // restrict pointers: the buffers never alias, and the loops below vectorise only when the compiler knows it
  T* __restrict Qm = w.QK.data();
  T* __restrict Kbm = w.QK.data() + C * K;
  T* __restrict em_ = w.em.data();
  T* __restrict ki = w.ki.data();
  T* __restrict qg = w.qg.data();
  T* __restrict kd = w.kd.data();
  const T* __restrict qf = w.q.data();
  const T* __restrict kf = w.k.data();
  const T* __restrict vf = w.v.data();
  const T* __restrict G = w.G.data();
  const T* __restrict m = w.m.data();
  const T* __restrict eh = w.eh.data();
  for (int64_t r = 0; r < C; ++r) {
    const T bt = w.bt[r];
    T* __restrict rhs = w.RHS.data() + r * KV2;
    T* __restrict em_r = em_ + r * K;
    const T* __restrict G_r = G + r * K;
    for (int64_t d = 0; d < K; ++d) em_r[d] = G_r[d] - m[d];
    for (int64_t d = 0; d < K; ++d) em_r[d] = std::exp(em_r[d]);  // exp(G - m), within exp(+-span / 2)
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const int64_t i = r * K + d;
      const T em = em_r[d];
      Qm[i] = qf[i] * em;
      Kbm[i] = bt * kf[i] * em;
      ki[i] = kf[i] / em;  // k exp(m - G)
      qg[i] = Qm[i] * eh[d];
      rhs[d] = Kbm[i] * eh[d];  // kgb = beta exp(G) k
      kd[i] = ki[i] * eh[d];    // k exp(G_C - G)
    }
    for (int64_t d = 0; d < V; ++d) rhs[K + d] = bt * vf[r * V + d];
  }
  // [A; L] = QK ki^T: A = [q_r . exp(G_r - G_c) k_c]_{c <= r}, L the same for the beta k rows, c < r
  mm<T>(false, true, 2 * C, C, K, 1, w.QK.data(), K, w.ki.data(), K, 0, w.AL.data(), C);
  T* A = w.AL.data();
  T* L = w.AL.data() + C * C;
  for (int64_t r = 0; r < C; ++r) {
    std::fill(A + r * C + r + 1, A + (r + 1) * C, T(0));
    std::fill(L + r * C + r, L + (r + 1) * C, T(0));
  }
  // Tm = (I + L)^-1 by forward substitution: row r = e_r - sum_{c < r} L[r, c] Tm[c]
  T* Tm = w.Tm.data();
  std::fill(Tm, Tm + C * C, T(0));
  for (int64_t r = 0; r < C; ++r) {
    T* row = Tm + r * C;
    row[r] = T(1);
    for (int64_t c = 0; c < r; ++c) {
      const T coef = -L[r * C + c];
      const T* __restrict prev = Tm + c * C;
      T* __restrict out = row;
      #pragma omp simd
      for (int64_t j = 0; j <= c; ++j) out[j] += coef * prev[j];
    }
  }
  // [W | U] = Tm [kgb | beta v], then U -= W S
  mm<T>(false, false, C, KV2, C, 1, Tm, C, w.RHS.data(), KV2, 0, w.WU.data(), KV2);
  mm<T>(false, false, C, V, K, -1, w.WU.data(), KV2, S, V, 1, w.WU.data() + K, KV2);
  return rows;
}

template <typename T, typename in_t>
void forward_impl(const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta, const T* init,
                  const T* keep, in_t* o, T* states, const Shape& s, T scale) {
  const int64_t C = s.C, K = s.K, V = s.V, N = s.N, KV = K * V, KV2 = K + V;
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
        const T* U = w.WU.data() + K;  // [C, V], row stride K + V
        // O = (exp(G) q) S + A U
        mm<T>(false, false, C, V, K, 1, w.qg.data(), K, Sn, V, 0, w.O.data(), V);
        mm<T>(false, false, C, V, C, 1, w.AL.data(), C, U, KV2, 1, w.O.data(), V);
        store_rows(o, w.O.data(), s, b, h, n * C, rows, V, scale);
        // S' = exp(G_C) S + (exp(G_C - G) k)^T U
        for (int64_t d = 0; d < K; ++d)
          #pragma omp simd
          for (int64_t e = 0; e < V; ++e) Snext[d * V + e] = w.gam[d] * Sn[d * V + e];
        mm<T>(true, false, K, V, C, 1, w.kd.data(), K, U, KV2, 1, Snext, V);
        // the final state is never reset
        if (keep != nullptr && n + 1 < N && keep[b * N + n + 1] == T(0)) std::fill(Snext, Snext + KV, T(0));
      }
    }
  });
}

template <typename T, typename in_t>
void backward_impl(const in_t* q, const in_t* k, const in_t* v, const T* g, const T* beta, const T* keep,
                   const T* states, const in_t* dout, const T* dfinal, in_t* dq, in_t* dk, in_t* dv, T* dg,
                   T* dbeta, T* dinit, const Shape& s, T scale) {
  const int64_t C = s.C, K = s.K, V = s.V, N = s.N, KV = K * V, KV2 = K + V;
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
        const T* A = w.AL.data();
        const T* W = w.WU.data();      // [C, K], row stride K + V
        const T* U = w.WU.data() + K;  // [C, V], row stride K + V
        T* dO = w.dOR.data();
        T* dR = w.dOR.data() + C * V;
        load_rows(dO, dout, s, b, h, t0, rows, V);
        #pragma omp simd
        for (int64_t i = 0; i < C * V; ++i) dO[i] *= scale;
        // dU = A^T dO + kd dS'
        mm<T>(true, false, C, V, C, 1, A, C, dO, V, 0, w.dU.data(), V);
        mm<T>(false, false, C, V, K, 1, w.kd.data(), K, dSn, V, 1, w.dU.data(), V);
        // dS = qg^T dO + exp(G_C) dS' - W^T dU: the grad of the state entering this chunk
        T* dSp = w.dSp.data();
        mm<T>(true, false, K, V, C, 1, w.qg.data(), K, dO, V, 0, dSp, V);
        for (int64_t d = 0; d < K; ++d)
          #pragma omp simd
          for (int64_t e = 0; e < V; ++e) dSp[d * V + e] += w.gam[d] * dSn[d * V + e];
        mm<T>(true, false, K, V, C, -1, W, KV2, w.dU.data(), V, 1, dSp, V);
        // U = Tm R with R = beta v - kgb S: dR = Tm^T dU
        mm<T>(true, false, C, V, C, 1, w.Tm.data(), C, w.dU.data(), V, 0, dR, V);
        // [dA; -dL] = [dO; dR] U^T, masked to A's and L's triangles (dL = -dR U^T)
        mm<T>(false, true, 2 * C, C, V, 1, w.dOR.data(), V, U, KV2, 0, w.dAL.data(), C);
        T* dA = w.dAL.data();
        T* dL = w.dAL.data() + C * C;
        for (int64_t r = 0; r < C; ++r) {
          std::fill(dA + r * C + r + 1, dA + (r + 1) * C, T(0));
          for (int64_t c = 0; c < r; ++c) dL[r * C + c] = -dL[r * C + c];
          std::fill(dL + r * C + r, dL + (r + 1) * C, T(0));
        }
        // grads of the factors QK = [q; beta k] exp(G - m) and ki = k exp(m - G); the state terms qg, kgb,
        // kd are those factors times exp(G_C - m), held fixed (G_C's own term is added below):
        // [dQm; dKbm] = [dA; dL] ki + ([dO; -dR] S^T) exp(G_C - m), dki = [dA; dL]^T QK + (U dS'^T) exp(G_C - m)
        mm<T>(false, false, 2 * C, K, C, 1, w.dAL.data(), C, w.ki.data(), K, 0, w.dQK.data(), K);
        mm<T>(false, true, 2 * C, K, V, 1, w.dOR.data(), V, Sn, V, 0, w.tmp.data(), K);
        for (int64_t r = 0; r < 2 * C; ++r) {
          const T sign = r < C ? T(1) : T(-1);
          #pragma omp simd
          for (int64_t d = 0; d < K; ++d) w.dQK[r * K + d] += sign * w.tmp[r * K + d] * w.eh[d];
        }
        mm<T>(true, false, C, K, 2 * C, 1, w.dAL.data(), C, w.QK.data(), K, 0, w.dki.data(), K);
        mm<T>(false, true, C, K, V, 1, U, KV2, dSn, V, 0, w.tmp.data(), K);
        for (int64_t r = 0; r < C; ++r)
          #pragma omp simd
          for (int64_t d = 0; d < K; ++d) w.dki[r * K + d] += w.tmp[r * K + d] * w.eh[d];
        const T* Qm = w.QK.data();
        const T* Kbm = w.QK.data() + C * K;
        const T* dQm = w.dQK.data();
        const T* dKbm = w.dQK.data() + C * K;
        // dG: exp(G - m) on the Qm / Kbm rows, exp(m - G) on ki; S' scales with exp(G_C) as a whole
        #pragma omp simd
        for (int64_t i = 0; i < C * K; ++i) w.dG[i] = dQm[i] * Qm[i] + dKbm[i] * Kbm[i] - w.dki[i] * w.ki[i];
        for (int64_t d = 0; d < K; ++d) {
          T acc = 0;
          for (int64_t e = 0; e < V; ++e) acc += dSn[d * V + e] * Snext[d * V + e];
          w.dG[(C - 1) * K + d] += acc;
        }
        // G is the inclusive cumsum of g: dg_r = sum_{r' >= r} dG_r'
        for (int64_t r = C - 2; r >= 0; --r)
          #pragma omp simd
          for (int64_t d = 0; d < K; ++d) w.dG[r * K + d] += w.dG[(r + 1) * K + d];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t tok = (b * s.T_len + t0 + r) * s.H + h;
          const T bt = w.bt[r];
          T db = 0;
#pragma omp simd reduction(+ : db)
          for (int64_t d = 0; d < K; ++d) {
            const int64_t i = r * K + d;
            const T dbk = dKbm[i] * w.em[i];  // grad of beta k
            db += dbk * w.k[i];
            dq[tok * K + d] = static_cast<in_t>(dQm[i] * w.em[i]);
            dk[tok * K + d] = static_cast<in_t>(dbk * bt + w.dki[i] / w.em[i]);
            dg[tok * K + d] = w.dG[i];
          }
#pragma omp simd reduction(+ : db)
          for (int64_t e = 0; e < V; ++e) {
            db += dR[r * V + e] * w.v[r * V + e];
            dv[tok * V + e] = static_cast<in_t>(bt * dR[r * V + e]);
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

Shape shape_of(const at::Tensor& q, const at::Tensor& v, int64_t C) {
  Shape s;
  s.B = q.size(0);
  s.T_len = q.size(1);
  s.H = q.size(2);
  s.K = q.size(3);
  s.V = v.size(3);
  s.C = C;
  s.N = (s.T_len + C - 1) / C;
  return s;
}

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

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
    auto s = shape_of(q, v, chunk);
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
    auto s = shape_of(q, v, chunk);
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
