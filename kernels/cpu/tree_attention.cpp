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
//
// The AVX2 path computes each query as the portable one does, bit for bit, but shares the work: a task
// takes a kv head's query heads for a few tree rows, and reads each block of cached keys and values once
// for all of them; eight keys' dot products (and eight lane blocks of the weighted sum) run as independent
// chains. Long contexts are where this counts: at 4k positions attention is most of a pass.

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

// e_j = e^(s_j - max s) in place over a row's list; returns 1 / sum_j e_j, summed in 8 lanes by list position.
float softmax_weights(float* scores, int64_t count) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) top = std::max(top, scores[j]);
  float lanes[kLanes] = {};
  int64_t j = 0;
#ifdef SPECMESH_AVX2
  __m256 sum = _mm256_setzero_ps();
  for (; j + kLanes <= count; j += kLanes) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_storeu_ps(lanes, sum);
#endif
  for (; j < count; ++j) {
    scores[j] = exp_nonpositive(scores[j] - top);
    lanes[j % kLanes] += scores[j];
  }
  return 1.0f / lane_sum(lanes);
}

#ifdef SPECMESH_AVX2
constexpr int64_t kKeyBlock = 64;  // cache positions whose K (or V) rows stay in L1 while a task's queries use them
constexpr int64_t kRowBlock = 4;   // tree rows per task: with the kv head's query heads, the queries sharing them

// q . k for 8 keys at once: each key's 8-lane fused multiply-adds as in `dot`, then the 8 horizontal sums
// together, each in horizontal_sum's order ((x0+x4 + x1+x5) + (x2+x6 + x3+x7)): `dot`'s bits, with eight
// independent chains instead of one.
inline __m256 dot8(const float* q, const float* const* k, int64_t dim) {
  __m256 a[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) a[l] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __m256 x = _mm256_loadu_ps(q + i);
    for (int64_t l = 0; l < kLanes; ++l) a[l] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[l] + i), a[l]);
  }
  // key l's low half + high half, keys l and l + 4 in one register: (x0+x4, x1+x5, x2+x6, x3+x7 | ...)
  __m256 halves[4];
  for (int l = 0; l < 4; ++l)
    halves[l] = _mm256_add_ps(_mm256_permute2f128_ps(a[l], a[l + 4], 0x20), _mm256_permute2f128_ps(a[l], a[l + 4], 0x31));
  // pair sums, then their sums: keys 0..3 in the low lane, 4..7 in the high one
  return _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]), _mm256_hadd_ps(halves[2], halves[3]));
}

// scores[j] = scale (q . k) for the n cache positions first.. in a row
inline void score_run(const float* q, const float* key, int64_t dim, int64_t first, int64_t n, float scale,
                      float* scores) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const float* k[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) k[l] = key + (first + j + l) * dim;
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(dot8(q, k, dim), _mm256_set1_ps(scale)));
  }
  for (; j < n; ++j) scores[j] = dot(q, key + (first + j) * dim, dim) * scale;
}

// acc[BLOCKS * 8] += sum_t weights[t] v_{position(t)}, t in order: each element's chain goes on where the last
// call left it (a store and a load round nothing), one chain per lane block.
template <int BLOCKS, typename Position>
inline void accumulate_blocks(const float* weights, const float* value, int64_t dim, int64_t n, Position position,
                              float* acc) {
  __m256 a[BLOCKS];
  for (int b = 0; b < BLOCKS; ++b) a[b] = _mm256_loadu_ps(acc + b * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(weights[t]);
    const float* v = value + position(t) * dim;
    for (int b = 0; b < BLOCKS; ++b) a[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + b * kLanes), a[b]);
  }
  for (int b = 0; b < BLOCKS; ++b) _mm256_storeu_ps(acc + b * kLanes, a[b]);
}

template <typename Position>
inline void accumulate(const float* weights, const float* value, int64_t dim, int64_t n, Position position, float* acc) {
  for (int64_t i = 0; i < dim; i += 8 * kLanes) {  // up to 8 lane blocks (64 values) in registers at a time
    switch (std::min<int64_t>(8, (dim - i) / kLanes)) {
      case 8: accumulate_blocks<8>(weights, value + i, dim, n, position, acc + i); break;
      case 7: accumulate_blocks<7>(weights, value + i, dim, n, position, acc + i); break;
      case 6: accumulate_blocks<6>(weights, value + i, dim, n, position, acc + i); break;
      case 5: accumulate_blocks<5>(weights, value + i, dim, n, position, acc + i); break;
      case 4: accumulate_blocks<4>(weights, value + i, dim, n, position, acc + i); break;
      case 3: accumulate_blocks<3>(weights, value + i, dim, n, position, acc + i); break;
      case 2: accumulate_blocks<2>(weights, value + i, dim, n, position, acc + i); break;
      default: accumulate_blocks<1>(weights, value + i, dim, n, position, acc + i); break;
    }
  }
}

// Buffers a thread reuses from task to task.
struct Scratch {
  std::vector<float> scores;                // [queries, cached + rows]
  std::vector<float> acc;                   // [queries, dim]
  std::vector<float> inverse;               // [queries]: 1 / each query's sum of weights
  std::vector<std::vector<int64_t>> tree;   // [rows of the task]: each one's visible tree positions
};

// One task: the query heads of kv head `kv` for tree rows [first, last). Their lists share the cache's
// positions, taken a block at a time by every query (K and V read once per block, not once per query);
// each query's arithmetic is the portable `attend`'s, in the same order.
void attend_tile(const float* qp, const float* key, const float* value, const bool* mask, int64_t heads,
                 int64_t group, int64_t kv, int64_t dim, int64_t cached, int64_t rows, int64_t first, int64_t last,
                 float scale, Scratch& scratch, float* op) {
  const int64_t queries = (last - first) * group, width = cached + rows;
  scratch.scores.resize(queries * width);
  scratch.acc.assign(queries * dim, 0.0f);
  scratch.tree.resize(last - first);
  for (int64_t r = 0; r < last - first; ++r) {
    scratch.tree[r].clear();
    for (int64_t j = 0; j < rows; ++j)
      if (mask[(first + r) * rows + j]) scratch.tree[r].push_back(cached + j);
  }
  const auto index = [&](int64_t i) { return ((first + i / group) * heads + kv * group + i % group) * dim; };
  float* scores = scratch.scores.data();
  for (int64_t p = 0; p < cached; p += kKeyBlock)
    for (int64_t i = 0; i < queries; ++i)
      score_run(qp + index(i), key, dim, p, std::min(kKeyBlock, cached - p), scale, scores + i * width + p);
  std::vector<float>& inverse = scratch.inverse;
  inverse.resize(queries);
  for (int64_t i = 0; i < queries; ++i) {
    const std::vector<int64_t>& tree = scratch.tree[i / group];
    float* s = scores + i * width;
    for (size_t m = 0; m < tree.size(); ++m) s[cached + m] = dot(qp + index(i), key + tree[m] * dim, dim) * scale;
    inverse[i] = softmax_weights(s, cached + static_cast<int64_t>(tree.size()));
  }
  float* acc = scratch.acc.data();
  for (int64_t p = 0; p < cached; p += kKeyBlock)
    for (int64_t i = 0; i < queries; ++i)
      accumulate(scores + i * width + p, value, dim, std::min(kKeyBlock, cached - p),
                 [p](int64_t t) { return p + t; }, acc + i * dim);
  for (int64_t i = 0; i < queries; ++i) {
    const std::vector<int64_t>& tree = scratch.tree[i / group];
    accumulate(scores + i * width + cached, value, dim, static_cast<int64_t>(tree.size()),
               [&tree](int64_t t) { return tree[t]; }, acc + i * dim);
    for (int64_t d = 0; d < dim; d += kLanes)  // then scaled once
      _mm256_storeu_ps(op + index(i) + d, _mm256_mul_ps(_mm256_loadu_ps(acc + i * dim + d), _mm256_set1_ps(inverse[i])));
  }
}

#else
// One (row, head): `keys` lists the visible positions in order; out [dim].
void attend(const float* q, const float* key, const float* value, int64_t dim, const std::vector<int64_t>& keys,
            float scale, std::vector<float>& scores, float* out) {
  const int64_t count = static_cast<int64_t>(keys.size());
  for (int64_t j = 0; j < count; ++j) scores[j] = dot(q, key + keys[j] * dim, dim) * scale;
  const float inverse = softmax_weights(scores.data(), count);
  for (int64_t i = 0; i < dim; ++i) {  // out = sum_j e_j v_j in list order, then scaled once
    float acc = 0.0f;
    for (int64_t t = 0; t < count; ++t) acc = std::fma(scores[t], value[keys[t] * dim + i], acc);
    out[i] = acc * inverse;
  }
}
#endif

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
#ifdef SPECMESH_AVX2
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, kv_heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / row_blocks, first = task % row_blocks * kRowBlock;
      attend_tile(qp, key.data_ptr<float>() + kv * key.stride(0), value.data_ptr<float>() + kv * value.stride(0), mp,
                  heads, group, kv, dim, cached, rows, first, std::min(rows, first + kRowBlock),
                  static_cast<float>(scale), scratch, op);
    }
  });
#else
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
#endif
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
