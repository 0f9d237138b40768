// y = x @ W.T for W in GGUF's own block formats (Q4_0, Q4_1, Q8_0: 32 weights along the input dimension a
// block, fp16 scales), read as the file stores them and computed the way llama.cpp computes them: each row
// of x is quantized to 8 bits per block of 32 (an fp32 scale per row and block), and each block's product
// is an integer dot product, scaled once.
//
// Why: one decoding step of a small model on a CPU is bound by the bytes of weights it streams (Q4_1 is
// ~6x fewer than fp32); scoring a tree of n rows then by the multiply-adds, and integer dot products do 32
// of them an instruction pair (AVX2: maddubs + madd) where fp32 does 8. PyTorch's own int4/int8 CPU
// kernels are vectorised for AVX-512 only and grow with every row.
//
// Layout of the work: output features in groups of 8 (one fp32 register, a lane per feature), a pair of
// groups (16 features) repacked once at load so that a pair's block is contiguous: its 16 fp16 d, its 16
// fp16 m (Q4_1), then its codes in 64-byte vectors of 16 features x 4 inputs (see code_at), a group's half
// of each vector 32 bytes. As many bytes as the file's blocks, and one load (plus two masks for 4-bit codes)
// a register of weights. For each row and block, the integer dot products of the features build up lane by
// lane, are scaled by the features' d times the row's block scale, and accumulated; rows in tiles share each
// block's weights. Builds by instruction set (kernels/cpu_ops.py picks the CPU's best): AVX2 multiplies a
// group at a time with maddubs + madd; VNNI with one dpbusd; AVX-512 VNNI a pair in one 512-bit register,
// tiling 16 rows.
//
// Exactness: everything a row's result depends on (its 8-bit activations, its integer dot products, the
// order of its fp32 operations) belongs to that row and runs the same whatever the other rows of the call,
// and the portable path repeats the AVX2 path's arithmetic operation for operation. So a row scored inside
// a tree equals the row scored alone, bit for bit. (Rounding activations to 8 bits is a step function: the
// rest of the runtime must be row-exact too, or last-bit differences grow into different tokens.)
//
// Blocks (bytes; q = codes): Q4_0 = d fp16, 16 bytes of nibbles        w = d (q - 8)
//                            Q4_1 = d fp16, m fp16, 16 bytes of nibbles w = d q + m
//                            Q8_0 = d fp16, 32 x int8                   w = d q
// In the file, nibble byte j holds input j (low nibble) and j + 16 (high). The packed weight is uint8
// [n / 16 (rounded up), k / 32, pair block bytes]; features past n are zeros.
// For a row x and a block: s = max |x| / 127, qx = round(x / s); the block adds
//   (d s) (q . qx) + m (s sum(qx))      (Q4_0: q - 8 is written d q + m with m = -8 d; Q8_0: m = 0)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECMESH_AVX2 1
// VNNI: one instruction multiplies 4 unsigned by 4 signed bytes per lane and adds them to the lane's int32,
// replacing maddubs + add + madd. The sums are the same integers, so the results are the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECMESH_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SPECMESH_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECMESH_AVX512 1  // two groups of 8 features a 512-bit register: half the instructions a product
#endif
#endif

namespace specmesh {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;  // output features of a group: one AVX2 register of fp32 sums
constexpr int64_t kPair = 2 * kTile;  // output features of a packed block

enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type ids

// Bytes of one block of a pair of groups: d (and m) as 16 fp16 each, then the codes; where they start.
constexpr int64_t pair_block_bytes(int64_t format) {
  return format == kQ4_0 ? 32 + 256 : format == kQ4_1 ? 64 + 256 : 32 + 512;
}
constexpr int64_t codes_offset(int64_t format) { return format == kQ4_1 ? 64 : 32; }

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef SPECMESH_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float value;
  if (exponent == 0)
    value = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal: exact
  else if (exponent == 31)
    value = mantissa ? NAN : INFINITY;
  else
    value = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  return (h & 0x8000) ? -value : value;
#endif
}

// A row's activations quantized per block: codes int8 [k], s and s * sum(codes) per block.
struct QuantizedRow {
  const int8_t* codes;
  const float* scale;
  const float* scaled_sum;
};

void quantize_row(const float* x, int64_t k, int8_t* codes, float* scale, float* scaled_sum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    int8_t* q = codes + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
#ifdef SPECMESH_AVX2
    const __m256 factor = _mm256_set1_ps(inverse);
    __m256i lanes[4];
    for (int p = 0; p < 4; ++p)  // cvtps rounds to nearest even, as nearbyint does by default
      lanes[p] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + p * 8), factor));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]), _mm256_packs_epi32(lanes[2], lanes[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the packs' interleave
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
#else
    for (int64_t i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
#endif
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) sum += q[i];
    scale[b] = amax / 127.0f;
    scaled_sum[b] = scale[b] * static_cast<float>(sum);
  }
}

// Code of feature f (0..15) and input i (0..31) in a pair's block: byte 4 f + i % 4 of a 64-byte vector;
// 8-bit, vector i / 4; 4-bit, vector i / 8, the low nibble for i % 8 < 4 and the high one for the rest.
template <Format F>
int32_t code_at(const uint8_t* codes, int64_t f, int64_t i) {
  if constexpr (F == kQ8_0) return static_cast<int8_t>(codes[i / 4 * 64 + f * 4 + i % 4]);
  const uint8_t byte = codes[i / 8 * 64 + f * 4 + i % 4];
  return i % 8 < 4 ? (byte & 0x0F) : (byte >> 4);
}

constexpr int64_t kRowTile = 8;  // at most, rows sharing one load (and unpack) of a block's weights

#ifdef SPECMESH_AVX2
// Rows a tile of at most `most` rows takes when `count` rows are split evenly (9 rows, most 8: 5 + 4).
int64_t rows_per_tile(int64_t count, int64_t most) {
  const int64_t tiles = (count + most - 1) / most;
  return (count + tiles - 1) / tiles;
}
#endif

// y[r][f] for rows [0, count) and the first `features` features of group `half` (0 or 1) of the pair whose
// first block `pair` points at.
template <Format F>
void multiply_group(const uint8_t* pair, int64_t half, int64_t blocks, int64_t features, const QuantizedRow* rows,
                    int64_t count, float* y, int64_t stride) {
  constexpr int64_t bytes = pair_block_bytes(F), codes_at = codes_offset(F);
#ifdef SPECMESH_AVX2
  // A group's half of a vector is one register: 8 features x 4 inputs (4-bit: two, the low and the high
  // nibbles). Each row's 4 activations are broadcast to the 8 features, so one maddubs + madd gives every
  // feature's partial dot product in its own lane: no horizontal sums. 4-bit: the 8 registers' 16-bit pair
  // sums add up without overflow (8 x 2 x 15 x 127 < 2^15) and are widened once a block.
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t per_tile = rows_per_tile(count, kRowTile);
  for (int64_t r0 = 0; r0 < count; r0 += per_tile) {
    const int64_t tile = std::min(per_tile, count - r0);
    __m256 acc[kRowTile];
    for (int64_t r = 0; r < kRowTile; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = pair + b * bytes;
      const uint8_t* codes = block + codes_at + half * 32;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + half * 16)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (F == kQ4_1)
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + half * 16)));
      if constexpr (F == kQ4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      __m256i w[8];
      if constexpr (F != kQ8_0)
        for (int64_t j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
          w[2 * j] = _mm256_and_si256(raw, nibble);
          w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
      for (int64_t r = 0; r < tile; ++r) {
        const QuantizedRow& x = rows[r0 + r];
        const int8_t* xq = x.codes + b * kBlock;
        __m256i dot = _mm256_setzero_si256();
        if constexpr (F == kQ8_0) {  // unsigned times signed bytes: move the weights' signs onto x
          for (int64_t j = 0; j < 8; ++j) {
            int32_t four;
            std::memcpy(&four, xq + j * 4, 4);
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
            const __m256i magnitude = _mm256_sign_epi8(q, q), signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), q);
#ifdef SPECMESH_DPBUSD
            dot = SPECMESH_DPBUSD(dot, magnitude, signed_x);
#else
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));  // |pair| <= 2 * 128 * 127: no saturation
#endif
          }
        } else {
#ifdef SPECMESH_DPBUSD
          for (int64_t j = 0; j < 8; ++j) {
            int32_t four;
            std::memcpy(&four, xq + j * 4, 4);
            dot = SPECMESH_DPBUSD(dot, w[j], _mm256_set1_epi32(four));
          }
#else
          __m256i pairs = _mm256_setzero_si256();
          for (int64_t j = 0; j < 8; ++j) {
            int32_t four;
            std::memcpy(&four, xq + j * 4, 4);
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(four)));
          }
          dot = _mm256_madd_epi16(pairs, ones);
#endif
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[b])), acc[r]);
        if constexpr (F != kQ8_0) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[b]), acc[r]);
      }
    }
    for (int64_t r = 0; r < tile; ++r) {
      alignas(32) float sums[kTile];
      _mm256_store_ps(sums, acc[r]);
      std::copy(sums, sums + features, y + (r0 + r) * stride);
    }
  }
#else
  for (int64_t r = 0; r < count; ++r)
    for (int64_t f = 0; f < features; ++f) {
      const QuantizedRow& x = rows[r];
      const int64_t lane = half * kTile + f;  // the feature's place in its pair
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = pair + b * bytes;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += code_at<F>(block + codes_at, lane, i) * x.codes[b * kBlock + i];
        const float d = half_to_float(block + 2 * lane);
        acc = std::fma(static_cast<float>(dot), d * x.scale[b], acc);
        if constexpr (F != kQ8_0) {
          const float m = F == kQ4_1 ? half_to_float(block + 32 + 2 * lane) : d * -8.0f;
          acc = std::fma(m, x.scaled_sum[b], acc);
        }
      }
      y[r * stride + f] = acc;
    }
#endif
}

#ifdef SPECMESH_AVX512
// multiply_group for both groups of a pair (features [0, features) of its 16), lanes 0-7 the first group's
// and 8-15 the second's: per lane the same integer dot products and the same fp32 operations as
// multiply_group, so the same bits.
template <Format F>
void multiply_pair(const uint8_t* pair, int64_t blocks, int64_t features, const QuantizedRow* rows, int64_t count,
                   float* y, int64_t stride) {
  constexpr int64_t bytes = pair_block_bytes(F), codes_at = codes_offset(F);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(-128);  // x ^ 0x80 = x + 128 as an unsigned byte
  constexpr int64_t kWideRowTile = 16;  // 32 registers: twice the rows share a block's decoded weights
  const int64_t per_tile = rows_per_tile(count, kWideRowTile);
  for (int64_t r0 = 0; r0 < count; r0 += per_tile) {
    const int64_t tile = std::min(per_tile, count - r0);
    __m512 acc[kWideRowTile];
    for (int64_t r = 0; r < kWideRowTile; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = pair + b * bytes;
      const uint8_t* codes = block + codes_at;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      __m512 m = _mm512_setzero_ps();
      if constexpr (F == kQ4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      if constexpr (F == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      __m512i w[8];
      __m512i offset = _mm512_setzero_si512();  // Q8_0: 128 x each feature's sum of codes in this block
      if constexpr (F == kQ8_0) {
        for (int64_t j = 0; j < 8; ++j) {
          w[j] = _mm512_loadu_si512(codes + j * 64);
          offset = _mm512_dpbusd_epi32(offset, _mm512_set1_epi8(-128), w[j]);  // unsigned 128 times each code
        }
      } else {
        for (int64_t j = 0; j < 4; ++j) {
          const __m512i raw = _mm512_loadu_si512(codes + j * 64);
          w[2 * j] = _mm512_and_si512(raw, nibble);
          w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
      }
      for (int64_t r = 0; r < tile; ++r) {
        const QuantizedRow& x = rows[r0 + r];
        const int8_t* xq = x.codes + b * kBlock;
        __m512i dots[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains: dpbusd's latency
        for (int64_t j = 0; j < 8; ++j) {                                      // bounds one chain of 8
          int32_t four;
          std::memcpy(&four, xq + j * 4, 4);
          const __m512i activations = _mm512_set1_epi32(four);
          if constexpr (F == kQ8_0)  // signed weights: x + 128 as the unsigned side, 128 sum(w) taken off below
            dots[j % 2] = _mm512_dpbusd_epi32(dots[j % 2], _mm512_xor_si512(activations, flip), w[j]);
          else
            dots[j % 2] = _mm512_dpbusd_epi32(dots[j % 2], w[j], activations);
        }
        __m512i dot = _mm512_add_epi32(dots[0], dots[1]);
        if constexpr (F == kQ8_0) dot = _mm512_sub_epi32(dot, offset);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[b])), acc[r]);
        if constexpr (F != kQ8_0) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[b]), acc[r]);
      }
    }
    for (int64_t r = 0; r < tile; ++r) {
      alignas(64) float sums[kPair];
      _mm512_store_ps(sums, acc[r]);
      std::copy(sums, sums + features, y + (r0 + r) * stride);
    }
  }
}
#endif

template <Format F>
void multiply(const uint8_t* weights, int64_t n, int64_t k, const QuantizedRow* rows, int64_t count, float* y) {
  const int64_t blocks = k / kBlock, pair_bytes = blocks * pair_block_bytes(F);
  at::parallel_for(0, (n + kPair - 1) / kPair, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPair;
      const uint8_t* pair = weights + p * pair_bytes;
#ifdef SPECMESH_AVX2
      if (p + 1 < end)  // streamed weights are never in cache: ask for the next pair's now
        for (int64_t i = 0; i < pair_bytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pair + pair_bytes + i), _MM_HINT_T0);
#endif
#ifdef SPECMESH_AVX512
      multiply_pair<F>(pair, blocks, std::min(kPair, n - first), rows, count, y + first, n);
#else
      for (int64_t half = 0; half < 2 && first + half * kTile < n; ++half)
        multiply_group<F>(pair, half, blocks, std::min(kTile, n - first - half * kTile), rows, count,
                          y + first + half * kTile, n);
#endif
    }
  });
}

}  // namespace

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t out_features) {
  TORCH_CHECK(format == kQ4_0 || format == kQ4_1 || format == kQ8_0,
              "block_linear: format must be GGML type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), got ", format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "block_linear: x must be a 2-d fp32 CPU tensor");
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.device().is_cpu(),
              "block_linear: the weight must be contiguous uint8 [pairs of 16 features, blocks, bytes] on the CPU");
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(k % kBlock == 0 && weight.size(1) == k / kBlock && weight.size(2) == pair_block_bytes(format),
              "block_linear: x has ", k, " inputs; the weight has ", weight.size(1), " blocks of ", weight.size(2),
              " bytes (format ", format, " needs ", pair_block_bytes(format), ")");
  TORCH_CHECK(n > (weight.size(0) - 1) * kPair && n <= weight.size(0) * kPair, "block_linear: ", n,
              " output features do not fill ", weight.size(0), " pairs of groups of 8");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;

  const int64_t blocks = k / kBlock;
  at::Tensor codes = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, rows, blocks}, x.options());
  std::vector<QuantizedRow> quantized(rows);
  for_each_row(rows, [&](int64_t r) {
    int8_t* c = codes.data_ptr<int8_t>() + r * k;
    float* s = scales.data_ptr<float>() + r * blocks;
    float* sums = s + rows * blocks;
    quantize_row(input.data_ptr<float>() + r * k, k, c, s, sums);
    quantized[r] = {c, s, sums};
  });
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  if (format == kQ4_0) multiply<kQ4_0>(w, n, k, quantized.data(), rows, out);
  else if (format == kQ4_1) multiply<kQ4_1>(w, n, k, quantized.data(), rows, out);
  else multiply<kQ8_0>(w, n, k, quantized.data(), rows, out);
  return y;
}

}  // namespace specmesh

#ifndef SPECMESH_OPS
#define SPECMESH_OPS specmesh_cpu  // the tests build the portable path beside the AVX2 one under another name
#endif

TORCH_LIBRARY(SPECMESH_OPS, m) {
  m.def("block_linear(Tensor x, Tensor weight, int format, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPECMESH_OPS, CPU, m) { m.impl("block_linear", &specmesh::block_linear); }
