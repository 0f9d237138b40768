// One Llama-family decoder layer over a batch of token trees, in one call, on GGUF blocks (CPU):
// RMSNorm -> q/k/v -> RoPE -> K/V written into each request's cache -> tree attention -> output
// projection + residual -> RMSNorm -> gate/up -> SiLU(gate) * up -> down + residual.
// With `prefix` [rows, p], q/k/v read [prefix, RMSNorm(x)] (p + hidden wide): a feature drafter's layer
// reads the next token's embedding beside its feature (drafters/feature.py), the residual still x.
//
// Why: a small model's step on a CPU is ~40 PyTorch calls a layer besides the linears (norms, slices,
// RoPE, copies), several ms a step of dispatch; here they are loops over a row at a time. Every op is
// row-exact (a row's result depends on that row, and on the keys it sees in position order), as the
// 8-bit activations of the block linears need (see block_linear.cpp).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "vector_math.h"

namespace specmesh {
namespace {

// y = weight * (x / sqrt(mean(x^2) + eps)) for each row of x [rows, hidden].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(hidden % kLanes == 0 && weight.numel() == hidden, "llama_layer: hidden size ", hidden,
              " (a multiple of 8, the norm's weight's size)");
  at::Tensor y = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for_each_row(rows, [&](int64_t r) {
    const float* v = x.data_ptr<float>() + r * hidden;
    float* out = y.data_ptr<float>() + r * hidden;
    float lanes[kLanes] = {};
#ifdef SPECMESH_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < hidden; i += kLanes) {
      const __m256 a = _mm256_loadu_ps(v + i);
      acc = _mm256_fmadd_ps(a, a, acc);
    }
    _mm256_storeu_ps(lanes, acc);
#else
    for (int64_t i = 0; i < hidden; i += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::fma(v[i + l], v[i + l], lanes[l]);
#endif
    const float inverse = 1.0f / std::sqrt(lane_sum(lanes) / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) out[i] = w[i] * (v[i] * inverse);
  });
  return y;
}

// x[i] cos[i] + rotate_half(x)[i] sin[i] over one head of `dim` values, into out.
inline void rope(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    out[i] = x[i] * cos[i] + rotated * sin[i];
  }
}

// silu(gate) * up for each row of gate_up [rows, 2 * intermediate] -> [rows, intermediate]; silu(g) =
// g / (1 + e^-g), written with e^-|g| so the exponential's argument is never positive.
at::Tensor silu_and_multiply(const at::Tensor& gate_up, int64_t intermediate) {
  const int64_t rows = gate_up.size(0);
  at::Tensor y = at::empty({rows, intermediate}, gate_up.options());
  for_each_row(rows, [&](int64_t r) {
    const float* gate = gate_up.data_ptr<float>() + r * 2 * intermediate;
    const float* up = gate + intermediate;
    float* out = y.data_ptr<float>() + r * intermediate;
    int64_t i = 0;
#ifdef SPECMESH_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (; i + kLanes <= intermediate; i += kLanes) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 t = exp_nonpositive(_mm256_or_ps(g, sign));  // e^-|g|
      const __m256 positive = _mm256_div_ps(g, _mm256_add_ps(one, t));
      const __m256 negative = _mm256_div_ps(_mm256_mul_ps(g, t), _mm256_add_ps(one, t));
      const __m256 silu = _mm256_blendv_ps(positive, negative, g);  // g's sign bit picks
      _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < intermediate; ++i) {
      const float g = gate[i], t = exp_nonpositive(-std::fabs(g));
      const float silu = std::signbit(g) ? (g * t) / (1.0f + t) : g / (1.0f + t);
      out[i] = silu * up[i];
    }
  });
  return y;
}

at::Tensor add_bias(at::Tensor y, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value()) y.add_(*bias);  // row by row: elementwise
  return y;
}

}  // namespace

at::Tensor llama_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                       const at::Tensor& qkv, int64_t qkv_format, const c10::optional<at::Tensor>& qkv_bias,
                       const at::Tensor& out, int64_t out_format, const at::Tensor& gate_up, int64_t gate_up_format,
                       const at::Tensor& down, int64_t down_format, const at::Tensor& cos, const at::Tensor& sin,
                       at::TensorList kv, at::IntArrayRef cached, at::IntArrayRef cu_rows, at::TensorList masks,
                       int64_t heads, int64_t kv_heads, int64_t intermediate, double eps, double scale,
                       const c10::optional<at::Tensor>& prefix) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "llama_layer: x must be contiguous fp32 [rows, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1), requests = static_cast<int64_t>(kv.size());
  const int64_t dim = cos.size(1), q_size = heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == rows && cos.is_contiguous() && sin.is_contiguous(),
              "llama_layer: cos and sin must be contiguous [rows, head_dim]");
  TORCH_CHECK(static_cast<int64_t>(cached.size()) == requests && static_cast<int64_t>(masks.size()) == requests &&
                  static_cast<int64_t>(cu_rows.size()) == requests + 1 && cu_rows[requests] == rows,
              "llama_layer: one cache, cached length and mask per request, and cu_rows delimiting the rows");

  at::Tensor h = rms_norm(x, input_norm, static_cast<float>(eps));
  if (prefix.has_value()) {
    TORCH_CHECK(prefix->dim() == 2 && prefix->size(0) == rows && prefix->scalar_type() == at::kFloat,
                "llama_layer: prefix must be fp32 [rows, p]");
    h = at::cat({*prefix, h}, 1);
  }
  const at::Tensor projected = add_bias(block_linear(h, qkv, qkv_format, q_size + 2 * kv_size), qkv_bias);
  at::Tensor q = at::empty({rows, heads, dim}, x.options());
  std::vector<int64_t> owner(rows);  // the request of each row
  for (int64_t s = 0; s < requests; ++s) {
    const at::Tensor& cache = kv[s];  // [2, kv_heads, capacity, dim]
    TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(1) == kv_heads && cache.size(3) == dim &&
                    cache.is_contiguous() && cache.scalar_type() == at::kFloat,
                "llama_layer: a request's cache must be contiguous fp32 [2, kv_heads, capacity, head_dim]");
    TORCH_CHECK(cached[s] + cu_rows[s + 1] - cu_rows[s] <= cache.size(2), "llama_layer: request ", s,
                " needs ", cached[s] + cu_rows[s + 1] - cu_rows[s], " positions, its cache holds ", cache.size(2));
    std::fill(owner.begin() + cu_rows[s], owner.begin() + cu_rows[s + 1], s);
  }
  for_each_row(rows, [&](int64_t r) {  // RoPE, and the row's K/V into its request's cache
    const int64_t s = owner[r];
    const at::Tensor& cache = kv[s];
    float* keys = cache.data_ptr<float>();
    float* values = keys + kv_heads * cache.size(2) * dim;
    const float* row = projected.data_ptr<float>() + r * (q_size + 2 * kv_size);
    const float *c = cos.data_ptr<float>() + r * dim, *sn = sin.data_ptr<float>() + r * dim;
    const int64_t position = cached[s] + r - cu_rows[s];
    for (int64_t head = 0; head < heads; ++head)
      rope(row + head * dim, c, sn, dim, q.data_ptr<float>() + (r * heads + head) * dim);
    for (int64_t head = 0; head < kv_heads; ++head) {
      rope(row + q_size + head * dim, c, sn, dim, keys + (head * cache.size(2) + position) * dim);
      std::copy(row + q_size + kv_size + head * dim, row + q_size + kv_size + (head + 1) * dim,
                values + (head * cache.size(2) + position) * dim);
    }
  });
  at::Tensor attended = at::empty({rows, heads, dim}, x.options());
  for (int64_t s = 0; s < requests; ++s) {
    const int64_t first = cu_rows[s], last = cu_rows[s + 1];
    const at::Tensor& cache = kv[s];
    attended.slice(0, first, last).copy_(
        tree_attention(q.slice(0, first, last), cache[0], cache[1], cached[s], masks[s], scale));
  }
  const at::Tensor x1 = x + block_linear(attended.view({rows, q_size}), out, out_format, hidden);
  const at::Tensor h2 = rms_norm(x1, post_norm, static_cast<float>(eps));
  const at::Tensor activated =
      silu_and_multiply(block_linear(h2, gate_up, gate_up_format, 2 * intermediate), intermediate);
  return x1 + block_linear(activated, down, down_format, hidden);
}

}  // namespace specmesh

#ifndef SPECMESH_OPS
#define SPECMESH_OPS specmesh_cpu
#endif

TORCH_LIBRARY_FRAGMENT(SPECMESH_OPS, m) {
  m.def("llama_layer(Tensor x, Tensor input_norm, Tensor post_norm, Tensor qkv, int qkv_format, Tensor? qkv_bias, "
        "Tensor out, int out_format, Tensor gate_up, int gate_up_format, Tensor down, int down_format, Tensor cos, "
        "Tensor sin, Tensor(a!)[] kv, int[] cached, int[] cu_rows, Tensor[] masks, int heads, int kv_heads, "
        "int intermediate, float eps, float scale, Tensor? prefix=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPECMESH_OPS, CPU, m) { m.impl("llama_layer", &specmesh::llama_layer); }
