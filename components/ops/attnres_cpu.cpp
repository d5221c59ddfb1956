// The AttnRes depth read for the CPU (components/ops/attnres.py has the equations and the PyTorch form), forward
// and backward each in one pass over the tokens: a token's S source rows are read into cache once and scored,
// softmaxed and mixed there, where the PyTorch form makes a pass over memory per step of the read.
//
//   score_i = (u_i . qw) / sqrt(mean(u_i^2) + eps),   qw = query * gain
//   a       = softmax_i(score)
//   h       = sum_i a_i u_i
//
// Layouts: S sources [N, d] in one dtype (bf16, fp32 or fp64), h [N, d] in the same; qw [d] in the compute dtype
// (fp32, or fp64 for fp64 sources). The backward recomputes the scores from the sources (nothing else is saved)
// and sums qw's gradient per tile of tokens, then over the tiles in order (the same bits whatever the thread
// count).

// only the ATen headers used: ATen/ATen.h (every operator) adds several seconds to each first-use build
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 64;  // tokens per work item

template <typename S>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

// rstd, the raw dot u . qw and the score of every source of token n; returns the softmax weights in a
template <typename S, typename A>
inline void token_scores(const std::vector<const S*>& src, int64_t n, int64_t d, const A* qw, A eps, A* rstd,
                         A* dot, A* a) {
  const int64_t count = static_cast<int64_t>(src.size());
  A best = std::numeric_limits<A>::lowest();
  for (int64_t i = 0; i < count; ++i) {
    const S* u = src[i] + n * d;
    A ss = 0, uq = 0;
#pragma omp simd reduction(+ : ss, uq)
    for (int64_t c = 0; c < d; ++c) {
      const A x = static_cast<A>(u[c]);
      ss += x * x;
      uq += x * qw[c];
    }
    rstd[i] = A(1) / std::sqrt(ss / static_cast<A>(d) + eps);
    dot[i] = uq;
    a[i] = uq * rstd[i];
    best = std::max(best, a[i]);
  }
  A z = 0;
  for (int64_t i = 0; i < count; ++i) {
    a[i] = std::exp(a[i] - best);
    z += a[i];
  }
  for (int64_t i = 0; i < count; ++i) a[i] /= z;
}

// h = sum_i a_i u_i of token n
template <typename S, typename A>
inline void token_mix(const std::vector<const S*>& src, int64_t n, int64_t d, const A* a, A* h) {
  std::fill(h, h + d, A(0));
  for (size_t i = 0; i < src.size(); ++i) {
    const S* u = src[i] + n * d;
    const A w = a[i];
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) h[c] += w * static_cast<A>(u[c]);
  }
}

// The RMSNorm that follows a read (components/nn/rmsnorm.py): the read's result rounded to the sources' dtype
// (x), normalised in the compute dtype and rounded again (y), times the gain in the compute dtype (out).
// Returns 1 / sqrt(mean(x^2) + eps); x and y hold the rounded values in the compute dtype.
template <typename S, typename A>
inline A token_norm(const A* h, int64_t d, A eps, A* x, A* y) {
  A ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < d; ++c) {
    x[c] = static_cast<A>(static_cast<S>(h[c]));
    ss += x[c] * x[c];
  }
  const A r = A(1) / std::sqrt(ss / static_cast<A>(d) + eps);
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) y[c] = static_cast<A>(static_cast<S>(x[c] * r));
  return r;
}

// kNorm: out = RMSNorm(read) [N, d] in the compute dtype; else out = read [N, d] in the sources' dtype
template <bool kNorm, typename S, typename A, typename O>
void forward_impl(const std::vector<const S*>& src, const A* qw, A eps, const A* nw, A neps, O* out, int64_t N,
                  int64_t d) {
  const int64_t count = static_cast<int64_t>(src.size()), tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> rstd(count), dot(count), a(count), h(d), x(d), y(d);
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t n = tile * kTile; n < std::min(N, (tile + 1) * kTile); ++n) {
        token_scores(src, n, d, qw, eps, rstd.data(), dot.data(), a.data());
        token_mix(src, n, d, a.data(), h.data());
        O* o = out + n * d;
        if constexpr (kNorm) {
          token_norm<S>(h.data(), d, neps, x.data(), y.data());
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) o[c] = y[c] * nw[c];
        } else {
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) o[c] = static_cast<O>(h[c]);
        }
      }
    }
  });
}

// dout: [N, d] of the forward's output (O); writes every source's grad, qw's and (kNorm) the gain's
template <bool kNorm, typename S, typename A, typename O>
void backward_impl(const std::vector<const S*>& src, const A* qw, A eps, const A* nw, A neps, const O* dout,
                   const std::vector<S*>& dsrc, A* dqw, A* dnw, int64_t N, int64_t d) {
  const int64_t count = static_cast<int64_t>(src.size()), tiles = (N + kTile - 1) / kTile;
  const int64_t width = kNorm ? 2 * d : d;  // per tile: dqw, then (kNorm) the gain's grad
  std::vector<A> partial(tiles * width, A(0));
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> rstd(count), dot(count), a(count), da(count), g(d), h(d), x(d), y(d);
    for (int64_t tile = begin; tile < end; ++tile) {
      A* mine = partial.data() + tile * width;
      for (int64_t n = tile * kTile; n < std::min(N, (tile + 1) * kTile); ++n) {
        token_scores(src, n, d, qw, eps, rstd.data(), dot.data(), a.data());
        const O* go = dout + n * d;
        if constexpr (kNorm) {
          // through the norm (its roundings pass gradients unchanged): dy = dout gain, the gain's grad dout y,
          // dx = r (dy - xhat mean(dy xhat)) with xhat = x r, which is the read's grad
          token_mix(src, n, d, a.data(), h.data());
          const A r = token_norm<S>(h.data(), d, neps, x.data(), y.data());
          A* dnw_tile = mine + d;
          A m = 0;
#pragma omp simd reduction(+ : m)
          for (int64_t c = 0; c < d; ++c) {
            dnw_tile[c] += go[c] * y[c];
            m += go[c] * nw[c] * x[c];
          }
          m *= r / static_cast<A>(d);
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) g[c] = r * (go[c] * nw[c] - x[c] * r * m);
        } else {
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) g[c] = static_cast<A>(go[c]);
        }
        // da_i = g . u_i; the softmax's backward: dscore_i = a_i (da_i - sum_j a_j da_j)
        A mean_da = 0;
        for (int64_t i = 0; i < count; ++i) {
          const S* u = src[i] + n * d;
          A s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t c = 0; c < d; ++c) s += g[c] * static_cast<A>(u[c]);
          da[i] = s;
          mean_da += a[i] * s;
        }
        for (int64_t i = 0; i < count; ++i) {
          const S* u = src[i] + n * d;
          const A dscore = a[i] * (da[i] - mean_da);
          // score = (u . qw) rstd: d score / du = rstd qw - (u . qw) rstd^3 u / d
          const A wq = dscore * rstd[i];
          const A wu = -dscore * dot[i] * rstd[i] * rstd[i] * rstd[i] / static_cast<A>(d);
          const A wg = a[i];
          S* du = dsrc[i] + n * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) {
            const A xc = static_cast<A>(u[c]);
            du[c] = static_cast<S>(wg * g[c] + wq * qw[c] + wu * xc);
            mine[c] += wq * xc;
          }
        }
      }
    }
  });
  std::fill(dqw, dqw + d, A(0));
  if constexpr (kNorm) std::fill(dnw, dnw + d, A(0));
  for (int64_t tile = 0; tile < tiles; ++tile) {
    for (int64_t c = 0; c < d; ++c) dqw[c] += partial[tile * width + c];
    if constexpr (kNorm)
      for (int64_t c = 0; c < d; ++c) dnw[c] += partial[tile * width + d + c];
  }
}

void check(const std::vector<at::Tensor>& sources, const at::Tensor& qw) {
  TORCH_CHECK(!sources.empty(), "attnres_read: at least one source");
  const auto& first = sources[0];
  TORCH_CHECK(first.dim() == 2, "attnres_read: sources must be [N, d]");
  for (const auto& u : sources) {
    TORCH_CHECK(u.sizes() == first.sizes() && u.scalar_type() == first.scalar_type() && u.is_contiguous(),
                "attnres_read: sources must be contiguous and share shape and dtype");
  }
  TORCH_CHECK(qw.dim() == 1 && qw.size(0) == first.size(1) && qw.is_contiguous(), "attnres_read: qw must be [d]");
}

template <typename S>
std::vector<const S*> pointers(const std::vector<at::Tensor>& sources) {
  std::vector<const S*> out;
  for (const auto& u : sources) out.push_back(u.data_ptr<S>());
  return out;
}

// the optional norm gain, checked: [d] in the compute dtype
const at::Tensor* norm_of(const c10::optional<at::Tensor>& norm_weight, const at::Tensor& qw) {
  if (!norm_weight.has_value()) return nullptr;
  TORCH_CHECK(norm_weight->sizes() == qw.sizes() && norm_weight->scalar_type() == qw.scalar_type() &&
                  norm_weight->is_contiguous(),
              "attnres_read: norm_weight must be a contiguous [d] tensor in the compute dtype");
  return &*norm_weight;
}

at::Tensor attnres_forward(const std::vector<at::Tensor>& sources, const at::Tensor& qw, double eps,
                           const c10::optional<at::Tensor>& norm_weight, double norm_eps) {
  check(sources, qw);
  const at::Tensor* nw = norm_of(norm_weight, qw);
  auto out = nw ? at::empty(sources[0].sizes(), qw.options()) : at::empty_like(sources[0]);
  const int64_t N = sources[0].size(0), d = sources[0].size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, sources[0].scalar_type(), "attnres_forward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(qw.scalar_type() == c10::CppTypeToScalarType<A>::value, "attnres_read: qw in the compute dtype");
    const auto src = pointers<scalar_t>(sources);
    if (nw) {
      forward_impl<true, scalar_t, A, A>(src, qw.data_ptr<A>(), static_cast<A>(eps), nw->data_ptr<A>(),
                                         static_cast<A>(norm_eps), out.data_ptr<A>(), N, d);
    } else {
      forward_impl<false, scalar_t, A, scalar_t>(src, qw.data_ptr<A>(), static_cast<A>(eps), nullptr, A(0),
                                                 out.data_ptr<scalar_t>(), N, d);
    }
  });
  return out;
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> attnres_backward(
    const std::vector<at::Tensor>& sources, const at::Tensor& qw, const at::Tensor& dout, double eps,
    const c10::optional<at::Tensor>& norm_weight, double norm_eps) {
  check(sources, qw);
  const at::Tensor* nw = norm_of(norm_weight, qw);
  TORCH_CHECK(dout.sizes() == sources[0].sizes() && dout.is_contiguous() &&
                  dout.scalar_type() == (nw ? qw.scalar_type() : sources[0].scalar_type()),
              "attnres_read: dout must be contiguous, of the forward output's shape and dtype");
  std::vector<at::Tensor> dsources;
  for (const auto& u : sources) dsources.push_back(at::empty_like(u));
  auto dqw = at::empty_like(qw);
  // a custom op returns tensors, never None: an empty one when there is no norm
  auto dnw = nw ? at::empty_like(qw) : at::empty({0}, qw.options());
  const int64_t N = sources[0].size(0), d = sources[0].size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, sources[0].scalar_type(), "attnres_backward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(qw.scalar_type() == c10::CppTypeToScalarType<A>::value, "attnres_read: qw in the compute dtype");
    const auto src = pointers<scalar_t>(sources);
    std::vector<scalar_t*> dptr;
    for (auto& t : dsources) dptr.push_back(t.data_ptr<scalar_t>());
    if (nw) {
      backward_impl<true, scalar_t, A, A>(src, qw.data_ptr<A>(), static_cast<A>(eps), nw->data_ptr<A>(),
                                          static_cast<A>(norm_eps), dout.data_ptr<A>(), dptr, dqw.data_ptr<A>(),
                                          dnw.data_ptr<A>(), N, d);
    } else {
      backward_impl<false, scalar_t, A, scalar_t>(src, qw.data_ptr<A>(), static_cast<A>(eps), nullptr, A(0),
                                                  dout.data_ptr<scalar_t>(), dptr, dqw.data_ptr<A>(), nullptr, N,
                                                  d);
    }
  });
  return {dsources, dqw, dnw};
}

}  // namespace

TORCH_LIBRARY(k3_attnres_cpu, m) {
  m.def("forward(Tensor[] sources, Tensor qw, float eps, Tensor? norm_weight, float norm_eps) -> Tensor");
  m.def("backward(Tensor[] sources, Tensor qw, Tensor dout, float eps, Tensor? norm_weight, float norm_eps) -> "
        "(Tensor[], Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(k3_attnres_cpu, CPU, m) {
  m.impl("forward", &attnres_forward);
  m.impl("backward", &attnres_backward);
}
