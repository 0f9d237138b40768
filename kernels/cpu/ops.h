// The CPU kernels' entry points, for the ops that call one another (the fused layer).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace specmesh {

// fn(r) for every row r in [0, rows): on the calling thread for fewer than kRowsPerThread rows (waking the
// other threads costs more than a few rows' norms or quantization; measured: threading them made a
// one-row step slower), split over the threads for more. Each row's arithmetic is its own, so its result
// is the same bits on any thread.
constexpr int64_t kRowsPerThread = 4;
template <typename F>
inline void for_each_row(int64_t rows, const F& fn) {
  at::parallel_for(0, rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// x [rows, k] fp32 @ packed GGUF blocks (block_linear.cpp) -> [rows, out_features] fp32
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t out_features);

// query [rows, heads, dim] over key/value [kv_heads, capacity, dim] (tree_attention.cpp) -> [rows, heads, dim]
at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t cached,
                          const at::Tensor& mask, double scale);

}  // namespace specmesh
