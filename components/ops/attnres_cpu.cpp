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

#include <ATen/ATen.h>
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

template <typename S, typename A>
void forward_impl(const std::vector<const S*>& src, const A* qw, S* out, int64_t N, int64_t d, A eps) {
  const int64_t count = static_cast<int64_t>(src.size()), tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> rstd(count), dot(count), a(count), h(d);
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t n = tile * kTile; n < std::min(N, (tile + 1) * kTile); ++n) {
        token_scores(src, n, d, qw, eps, rstd.data(), dot.data(), a.data());
        std::fill(h.begin(), h.end(), A(0));
        for (int64_t i = 0; i < count; ++i) {
          const S* u = src[i] + n * d;
          const A w = a[i];
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) h[c] += w * static_cast<A>(u[c]);
        }
        S* o = out + n * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<S>(h[c]);
      }
    }
  });
}

template <typename S, typename A>
void backward_impl(const std::vector<const S*>& src, const A* qw, const S* dout, const std::vector<S*>& dsrc,
                   A* dqw, int64_t N, int64_t d, A eps) {
  const int64_t count = static_cast<int64_t>(src.size()), tiles = (N + kTile - 1) / kTile;
  std::vector<A> partial(tiles * d, A(0));  // dqw per tile
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> rstd(count), dot(count), a(count), da(count), g(d);
    for (int64_t tile = begin; tile < end; ++tile) {
      A* mine = partial.data() + tile * d;
      for (int64_t n = tile * kTile; n < std::min(N, (tile + 1) * kTile); ++n) {
        token_scores(src, n, d, qw, eps, rstd.data(), dot.data(), a.data());
        const S* go = dout + n * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) g[c] = static_cast<A>(go[c]);
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
            const A x = static_cast<A>(u[c]);
            du[c] = static_cast<S>(wg * g[c] + wq * qw[c] + wu * x);
            mine[c] += wq * x;
          }
        }
      }
    }
  });
  std::fill(dqw, dqw + d, A(0));
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int64_t c = 0; c < d; ++c) dqw[c] += partial[tile * d + c];
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

at::Tensor attnres_forward(const std::vector<at::Tensor>& sources, const at::Tensor& qw, double eps) {
  check(sources, qw);
  auto out = at::empty_like(sources[0]);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "attnres_forward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(qw.scalar_type() == c10::CppTypeToScalarType<A>::value, "attnres_read: qw in the compute dtype");
    forward_impl<scalar_t, A>(pointers<scalar_t>(sources), qw.data_ptr<A>(), out.data_ptr<scalar_t>(),
                              out.size(0), out.size(1), static_cast<A>(eps));
  });
  return out;
}

std::tuple<std::vector<at::Tensor>, at::Tensor> attnres_backward(const std::vector<at::Tensor>& sources,
                                                                 const at::Tensor& qw, const at::Tensor& dout,
                                                                 double eps) {
  check(sources, qw);
  TORCH_CHECK(dout.sizes() == sources[0].sizes() && dout.scalar_type() == sources[0].scalar_type() &&
                  dout.is_contiguous(),
              "attnres_read: dout must be contiguous, of a source's shape and dtype");
  std::vector<at::Tensor> dsources;
  for (size_t i = 0; i < sources.size(); ++i) dsources.push_back(at::empty_like(sources[i]));
  auto dqw = at::empty_like(qw);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dout.scalar_type(), "attnres_backward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(qw.scalar_type() == c10::CppTypeToScalarType<A>::value, "attnres_read: qw in the compute dtype");
    std::vector<scalar_t*> dptr;
    for (auto& t : dsources) dptr.push_back(t.data_ptr<scalar_t>());
    backward_impl<scalar_t, A>(pointers<scalar_t>(sources), qw.data_ptr<A>(), dout.data_ptr<scalar_t>(), dptr,
                               dqw.data_ptr<A>(), dout.size(0), dout.size(1), static_cast<A>(eps));
  });
  return {dsources, dqw};
}

}  // namespace

TORCH_LIBRARY(k3_attnres_cpu, m) {
  m.def("forward(Tensor[] sources, Tensor qw, float eps) -> Tensor");
  m.def("backward(Tensor[] sources, Tensor qw, Tensor dout, float eps) -> (Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(k3_attnres_cpu, CPU, m) {
  m.impl("forward", &attnres_forward);
  m.impl("backward", &attnres_backward);
}
