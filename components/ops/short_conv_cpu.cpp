// KDA's q/k/v prologue for the CPU: a short causal depthwise convolution, SiLU, and (for q and k) an L2
// normalisation of every head, forward and backward each in one pass over the tokens (components/ops/short_conv.py
// holds the reference composition and the dispatch).
//
//   y[t, p]   = sum_j taps[j, p] * x[t - (W - 1 - j), p]      (terms before the row or in another document are 0)
//   a[t, p]   = silu(y[t, p])
//   out[t, :] = a[t, :] / sqrt(sum_{p in head} a[t, p]^2 + eps) per head of head_dim channels (head_dim > 0),
//               or a[t, :] (head_dim == 0)
//
// Layouts: x and out [B, T, P] in one dtype (bf16, fp32 or fp64), taps [W, P] in the compute dtype (fp32, or
// fp64 for fp64 x), ids [B, T] (optional, int64): document ids, nondecreasing along a row. Everything is computed
// in the compute dtype and rounded once on the way out. The backward recomputes y and a from x (nothing is
// saved but the inputs) and sums the taps' gradient per tile of tokens, then over the tiles in order (the same
// bits whatever the thread count).

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

namespace {

// tokens per work item: one item is a run of tokens of one row, so the halo (the W - 1 tokens a tile reads
// before it, or its backward after it) stays small against the tile
constexpr int64_t kTile = 64;

template <typename S>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

struct Dims {
  int64_t B, T, P, W, head_dim;
};

// whether input token t - s adds to output token t of row `row` (the causal window, and its document)
inline bool tap_valid(const int64_t* ids, int64_t row, int64_t t, int64_t s) {
  return t - s >= 0 && (ids == nullptr || ids[row + t - s] == ids[row + t]);
}

// y, a = silu(y) and out (normalised a) of token t, all P channels; sig = sigmoid(y) kept for the backward.
// Returns nothing normalised when head_dim == 0 (out = a).
template <typename S, typename A>
inline void token_forward(const S* x, const A* taps, const int64_t* ids, int64_t row, int64_t t, const Dims& d,
                          A eps, A* y, A* sig, A* out, A* rnorm) {
  const int64_t P = d.P, W = d.W;
  std::fill(y, y + P, A(0));
  for (int64_t j = 0; j < W; ++j) {
    const int64_t s = W - 1 - j;
    if (!tap_valid(ids, row, t, s)) continue;
    const S* xs = x + (row + t - s) * P;
    const A* w = taps + j * P;
#pragma omp simd
    for (int64_t p = 0; p < P; ++p) y[p] += w[p] * static_cast<A>(xs[p]);
  }
#pragma omp simd
  for (int64_t p = 0; p < P; ++p) {
    sig[p] = A(1) / (A(1) + std::exp(-y[p]));
    out[p] = y[p] * sig[p];
  }
  if (d.head_dim == 0) return;
  for (int64_t h = 0; h < P / d.head_dim; ++h) {
    A* o = out + h * d.head_dim;
    A ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d.head_dim; ++i) ss += o[i] * o[i];
    const A r = A(1) / std::sqrt(ss + eps);
    rnorm[h] = r;
#pragma omp simd
    for (int64_t i = 0; i < d.head_dim; ++i) o[i] *= r;
  }
}

template <typename S, typename A>
void forward_impl(const S* x, const A* taps, const int64_t* ids, S* out, const Dims& d, A eps) {
  const int64_t tiles = (d.T + kTile - 1) / kTile;
  at::parallel_for(0, d.B * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> y(d.P), sig(d.P), a(d.P), rnorm(d.head_dim ? d.P / d.head_dim : 1);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles, t0 = (item % tiles) * kTile, t1 = std::min(d.T, t0 + kTile);
      const int64_t row = b * d.T;
      for (int64_t t = t0; t < t1; ++t) {
        token_forward(x, taps, ids, row, t, d, eps, y.data(), sig.data(), a.data(), rnorm.data());
        S* o = out + (row + t) * d.P;
#pragma omp simd
        for (int64_t p = 0; p < d.P; ++p) o[p] = static_cast<S>(a[p]);
      }
    }
  });
}

template <typename S, typename A>
void backward_impl(const S* x, const A* taps, const int64_t* ids, const S* dout, S* dx, A* dtaps, const Dims& d,
                   A eps) {
  const int64_t P = d.P, W = d.W, tiles = (d.T + kTile - 1) / kTile;
  // dtaps per work item, summed in item order at the end: the same bits whatever the thread count
  std::vector<A> partial(d.B * tiles * W * P, A(0));
  at::parallel_for(0, d.B * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> y(P), sig(P), a(P), rnorm(d.head_dim ? P / d.head_dim : 1);
    // dy of the tile's tokens and of the W - 1 after it (dx[t] reads dy[t .. t + W - 1])
    std::vector<A> dy((kTile + W - 1) * P);
    std::vector<A> acc(P);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles, t0 = (item % tiles) * kTile, t1 = std::min(d.T, t0 + kTile);
      const int64_t row = b * d.T, t_end = std::min(d.T, t1 + W - 1);
      A* mine = partial.data() + item * W * P;
      for (int64_t t = t0; t < t_end; ++t) {
        token_forward(x, taps, ids, row, t, d, eps, y.data(), sig.data(), a.data(), rnorm.data());
        const S* g = dout + (row + t) * P;
        A* dyt = dy.data() + (t - t0) * P;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) dyt[p] = static_cast<A>(g[p]);
        if (d.head_dim) {
          // out = a r with r = (|a|^2 + eps)^(-1/2): da = r dout - r^3 a <dout, a> = r (dout - out <dout, out>)
          for (int64_t h = 0; h < P / d.head_dim; ++h) {
            A* gh = dyt + h * d.head_dim;
            const A* oh = a.data() + h * d.head_dim;
            A dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d.head_dim; ++i) dot += gh[i] * oh[i];
            const A r = rnorm[h];
#pragma omp simd
            for (int64_t i = 0; i < d.head_dim; ++i) gh[i] = r * (gh[i] - oh[i] * dot);
          }
        }
        // silu'(y) = sig (1 + y (1 - sig))
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) dyt[p] *= sig[p] * (A(1) + y[p] * (A(1) - sig[p]));
      }
      for (int64_t t = t0; t < t1; ++t) {
        const A* dyt = dy.data() + (t - t0) * P;
        // taps: dtaps[j] += dy[t] x[t - s]
        for (int64_t j = 0; j < W; ++j) {
          const int64_t s = W - 1 - j;
          if (!tap_valid(ids, row, t, s)) continue;
          const S* xs = x + (row + t - s) * P;
          A* dt = mine + j * P;
#pragma omp simd
          for (int64_t p = 0; p < P; ++p) dt[p] += dyt[p] * static_cast<A>(xs[p]);
        }
        // input: dx[t] = sum_j taps[j] dy[t + s] over the outputs t + s that read t
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < W; ++j) {
          const int64_t s = W - 1 - j;
          if (t + s >= t_end || !tap_valid(ids, row, t + s, s)) continue;
          const A* dys = dy.data() + (t + s - t0) * P;
          const A* w = taps + j * P;
#pragma omp simd
          for (int64_t p = 0; p < P; ++p) acc[p] += w[p] * dys[p];
        }
        S* dxt = dx + (row + t) * P;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) dxt[p] = static_cast<S>(acc[p]);
      }
    }
  });
  std::fill(dtaps, dtaps + W * P, A(0));
  for (int64_t i = 0; i < d.B * tiles; ++i)
    for (int64_t p = 0; p < W * P; ++p) dtaps[p] += partial[i * W * P + p];
}

Dims dims_of(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& ids, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "short_conv: x must be a contiguous [B, T, P] tensor");
  TORCH_CHECK(taps.dim() == 2 && taps.size(1) == x.size(2) && taps.is_contiguous(),
              "short_conv: taps must be a contiguous [W, P] tensor with P = x.size(2)");
  TORCH_CHECK(head_dim >= 0 && (head_dim == 0 || x.size(2) % head_dim == 0),
              "short_conv: head_dim must be 0 or divide P");
  if (ids.has_value()) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->size(0) == x.size(0) &&
                    ids->size(1) == x.size(1),
                "short_conv: ids must be a contiguous int64 [B, T] tensor");
  }
  return {x.size(0), x.size(1), x.size(2), taps.size(0), head_dim};
}

const int64_t* ids_ptr(const c10::optional<at::Tensor>& ids) {
  return ids.has_value() ? ids->data_ptr<int64_t>() : nullptr;
}

at::Tensor short_conv_forward(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& ids,
                              int64_t head_dim, double eps) {
  const Dims d = dims_of(x, taps, ids, head_dim);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "short_conv_forward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(taps.scalar_type() == c10::CppTypeToScalarType<A>::value, "short_conv: taps in the compute dtype");
    forward_impl<scalar_t, A>(x.data_ptr<scalar_t>(), taps.data_ptr<A>(), ids_ptr(ids), out.data_ptr<scalar_t>(),
                              d, static_cast<A>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> short_conv_backward(const at::Tensor& x, const at::Tensor& taps,
                                                       const c10::optional<at::Tensor>& ids, const at::Tensor& dout,
                                                       int64_t head_dim, double eps) {
  const Dims d = dims_of(x, taps, ids, head_dim);
  TORCH_CHECK(dout.sizes() == x.sizes() && dout.scalar_type() == x.scalar_type() && dout.is_contiguous(),
              "short_conv: dout must be contiguous, of x's shape and dtype");
  auto dx = at::empty_like(x);
  auto dtaps = at::empty_like(taps);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "short_conv_backward", [&] {
    using A = typename Compute<scalar_t>::type;
    TORCH_CHECK(taps.scalar_type() == c10::CppTypeToScalarType<A>::value, "short_conv: taps in the compute dtype");
    backward_impl<scalar_t, A>(x.data_ptr<scalar_t>(), taps.data_ptr<A>(), ids_ptr(ids), dout.data_ptr<scalar_t>(),
                               dx.data_ptr<scalar_t>(), dtaps.data_ptr<A>(), d, static_cast<A>(eps));
  });
  return {dx, dtaps};
}

}  // namespace

TORCH_LIBRARY(k3_short_conv_cpu, m) {
  m.def("forward(Tensor x, Tensor taps, Tensor? ids, int head_dim, float eps) -> Tensor");
  m.def("backward(Tensor x, Tensor taps, Tensor? ids, Tensor dout, int head_dim, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(k3_short_conv_cpu, CPU, m) {
  m.impl("forward", &short_conv_forward);
  m.impl("backward", &short_conv_backward);
}
