// Tree attention on the CPU that is exact per row: a query row's output depends only on the keys it sees,
// in position order, never on how many rows the pass scores or which rows the mask hides.
//
// Why: a tree pass scores a row after the committed cache plus its ancestors in the tree; plain decoding
// scores the same row after a cache holding those same tokens. PyTorch's attention picks other kernels
// and summation blocks for the two shapes (last-bit differences), and the quantized linears round their
// activations to 8 bits, a step function that grows last-bit differences into different tokens. Here
// both see one list of keys and compute on it identically, so speculative decoding on quantized weights
// reproduces plain decoding bit for bit.
//
// Per query row i and head h (kv head h / (heads / kv_heads)): the visible keys are the cache's first
// `cached` positions, then the tree rows j with mask[i][j], in order. s_j = scale (q . k_j);
// out = sum_j e^(s_j - max s) v_j / sum_j e^(s_j - max s), every sum in list order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "ops.h"
#include "vector_math.h"

namespace specmesh {
namespace {

// q . k over head_dim (a multiple of 8): 8 lanes of fused multiply-adds, then the fixed horizontal sum.
inline float dot(const float* q, const float* k, int64_t dim) {
#ifdef SPECMESH_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
  return horizontal_sum(acc);
#else
  float acc[kLanes] = {};
  for (int64_t i = 0; i < dim; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = std::fma(q[i + l], k[i + l], acc[l]);
  return lane_sum(acc);
#endif
}

// One (row, head): `keys` lists the visible positions in order; out [dim].
void attend(const float* q, const float* key, const float* value, int64_t dim, const std::vector<int64_t>& keys,
            float scale, std::vector<float>& scores, float* out) {
  const int64_t count = static_cast<int64_t>(keys.size());
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = dot(q, key + keys[j] * dim, dim) * scale;
    top = std::max(top, scores[j]);
  }
  // weights e^(s - top), summed in 8 lanes by list position
  float lanes[kLanes] = {};
  int64_t j = 0;
#ifdef SPECMESH_AVX2
  __m256 sum = _mm256_setzero_ps();
  for (; j + kLanes <= count; j += kLanes) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(scores.data() + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_storeu_ps(lanes, sum);
#endif
  for (; j < count; ++j) {
    scores[j] = exp_nonpositive(scores[j] - top);
    lanes[j % kLanes] += scores[j];
  }
  const float inverse = 1.0f / lane_sum(lanes);
  // out = sum_j e_j v_j in list order, then scaled once
#ifdef SPECMESH_AVX2
  for (int64_t i = 0; i < dim; i += kLanes) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), _mm256_loadu_ps(value + keys[t] * dim + i), acc);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(acc, _mm256_set1_ps(inverse)));
  }
#else
  for (int64_t i = 0; i < dim; ++i) {
    float acc = 0.0f;
    for (int64_t t = 0; t < count; ++t) acc = std::fma(scores[t], value[keys[t] * dim + i], acc);
    out[i] = acc * inverse;
  }
#endif
}

}  // namespace

// query [rows, heads, dim]; key, value [kv_heads, capacity, dim] holding `cached` committed positions then
// the tree's rows; mask [rows, rows] bool (row i sees tree row j). Returns [rows, heads, dim].
at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t cached,
                          const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.device().is_cpu(),
              "tree_attention: query must be fp32 [rows, heads, dim] on the CPU");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && key.size(2) == dim && key.stride(2) == 1 &&
                  key.stride(1) == dim && value.stride(2) == 1 && value.stride(1) == dim,
              "tree_attention: key and value must be fp32 [kv_heads, capacity, dim], rows contiguous");
  const int64_t kv_heads = key.size(0);
  TORCH_CHECK(dim % kLanes == 0 && kv_heads > 0 && heads % kv_heads == 0, "tree_attention: head dim ", dim,
              " (multiple of 8), ", heads, " heads over ", kv_heads, " kv heads");
  TORCH_CHECK(cached >= 0 && cached + rows <= key.size(1), "tree_attention: ", cached, " cached + ", rows,
              " rows exceed the cache's ", key.size(1), " positions");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == rows && mask.size(1) == rows && mask.scalar_type() == at::kBool,
              "tree_attention: mask must be bool [rows, rows]");
  const at::Tensor q = query.contiguous(), visible = mask.contiguous();
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  const float* qp = q.data_ptr<float>();
  const bool* mp = visible.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> scores(cached + rows);
    int64_t listed_for = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / heads, head = task % heads;
      if (row != listed_for) {  // the row's visible positions, in order
        keys.clear();
        for (int64_t p = 0; p < cached; ++p) keys.push_back(p);
        for (int64_t j = 0; j < rows; ++j)
          if (mp[row * rows + j]) keys.push_back(cached + j);
        listed_for = row;
      }
      const int64_t kv = head / group;
      attend(qp + (row * heads + head) * dim, key.data_ptr<float>() + kv * key.stride(0),
             value.data_ptr<float>() + kv * value.stride(0), dim, keys, static_cast<float>(scale), scores,
             op + (row * heads + head) * dim);
    }
  });
  return out;
}

}  // namespace specmesh

#ifndef SPECMESH_OPS
#define SPECMESH_OPS specmesh_cpu
#endif

TORCH_LIBRARY_FRAGMENT(SPECMESH_OPS, m) {
  m.def("tree_attention(Tensor query, Tensor key, Tensor value, int cached, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPECMESH_OPS, CPU, m) { m.impl("tree_attention", &specmesh::tree_attention); }
