// The CPU kernels' entry points, for the ops that call one another (the fused layer).
#pragma once

#include <ATen/ATen.h>

namespace specmesh {

// x [rows, k] fp32 @ packed GGUF blocks (block_linear.cpp) -> [rows, out_features] fp32
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t out_features);

// query [rows, heads, dim] over key/value [kv_heads, capacity, dim] (tree_attention.cpp) -> [rows, heads, dim]
at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t cached,
                          const at::Tensor& mask, double scale);

}  // namespace specmesh
