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
// Layout of the work: output features in groups of 8 (one fp32 register, a lane per feature), repacked once
// at load so that a group's block is contiguous: its 8 fp16 d, its 8 fp16 m (Q4_1), then its codes in 8
// chunks of 4 inputs x 8 features (interleaved: see code_at). As many bytes as the file's blocks. For each
// row and block, the integer dot products of the 8 features build up lane by lane, are scaled by the
// features' d times the row's block scale, and accumulated; rows in tiles of up to 8 share each block's weights.
// Builds by instruction set (kernels/cpu_ops.py picks the CPU's best): AVX2 multiplies with maddubs + madd;
// VNNI with one dpbusd; AVX-512 VNNI puts two groups in one 512-bit register (16 features) and tiles 16 rows.
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
// [n / 8 (rounded up), k / 32, group block bytes]; features past n are zeros.
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
constexpr int64_t kTile = 8;  // output features a pass: one AVX2 register of fp32 sums

enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type ids

// Bytes of one block of a group of 8 features: d (and m) as 8 fp16 each, then the codes.
int64_t group_block_bytes(int64_t format) { return format == kQ4_0 ? 16 + 128 : format == kQ4_1 ? 32 + 128 : 16 + 256; }

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

// Code of feature f (0..7) and input i (0..31) in a group's block: byte 4 j + p of chunk j = i / 4 holds
// inputs 4 j .. 4 j + 3 of feature p / 4 (low nibble, 4-bit) and of feature 4 + p / 4 (high nibble);
// 8-bit chunks are 32 bytes, byte p = feature p / 4, input 4 j + p % 4.
template <Format F>
int32_t code_at(const uint8_t* codes, int64_t f, int64_t i) {
  const int64_t chunk = i / 4, lane = i % 4;
  if constexpr (F == kQ8_0) return static_cast<int8_t>(codes[chunk * 32 + f * 4 + lane]);
  const uint8_t byte = codes[chunk * 16 + (f % 4) * 4 + lane];
  return f < 4 ? (byte & 0x0F) : (byte >> 4);
}

constexpr int64_t kRowTile = 8;  // at most, rows sharing one load (and unpack) of a block's weights

#ifdef SPECMESH_AVX2
// Rows a tile of at most `most` rows takes when `count` rows are split evenly (9 rows, most 8: 5 + 4).
int64_t rows_per_tile(int64_t count, int64_t most) {
  const int64_t tiles = (count + most - 1) / most;
  return (count + tiles - 1) / tiles;
}
#endif

// y[r][f] for rows [0, count) and the group's first `features` features; `group` points at its first block.
template <Format F>
void multiply_group(const uint8_t* group, int64_t blocks, int64_t features, const QuantizedRow* rows, int64_t count,
                    float* y, int64_t stride) {
  constexpr int64_t bytes = F == kQ4_0 ? 16 + 128 : F == kQ4_1 ? 32 + 128 : 16 + 256;
  constexpr int64_t codes_at = F == kQ4_1 ? 32 : 16;
#ifdef SPECMESH_AVX2
  // Chunk j of a block is one register: 8 features x 4 inputs. Each row's 4 activations of the chunk are
  // broadcast to the 8 features, so one maddubs + madd gives every feature's partial dot product in its own
  // lane: no horizontal sums. 4-bit: the 8 chunks' 16-bit pair sums add up without overflow (8 x 2 x 15 x
  // 127 < 2^15) and are widened once a block.
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const int64_t per_tile = rows_per_tile(count, kRowTile);
  for (int64_t r0 = 0; r0 < count; r0 += per_tile) {
    const int64_t tile = std::min(per_tile, count - r0);
    __m256 acc[kRowTile];
    for (int64_t r = 0; r < kRowTile; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = group + b * bytes;
      const uint8_t* codes = block + codes_at;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (F == kQ4_1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
      if constexpr (F == kQ4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      __m256i w[8];
      if constexpr (F != kQ8_0)
        for (int64_t j = 0; j < 8; ++j) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * 16));
          w[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), _mm_and_si128(raw, nibble));
        }
      for (int64_t r = 0; r < tile; ++r) {
        const QuantizedRow& x = rows[r0 + r];
        const int8_t* xq = x.codes + b * kBlock;
        __m256i dot = _mm256_setzero_si256();
        if constexpr (F == kQ8_0) {  // unsigned times signed bytes: move the weights' signs onto x
          for (int64_t j = 0; j < 8; ++j) {
            int32_t four;
            std::memcpy(&four, xq + j * 4, 4);
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 32));
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
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = group + b * bytes;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += code_at<F>(block + codes_at, f, i) * x.codes[b * kBlock + i];
        const float d = half_to_float(block + 2 * f);
        acc = std::fma(static_cast<float>(dot), d * x.scale[b], acc);
        if constexpr (F != kQ8_0) {
          const float m = F == kQ4_1 ? half_to_float(block + 16 + 2 * f) : d * -8.0f;
          acc = std::fma(m, x.scaled_sum[b], acc);
        }
      }
      y[r * stride + f] = acc;
    }
#endif
}

#ifdef SPECMESH_AVX512
__m512i join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

__m512i load_pair(const uint8_t* low, const uint8_t* high) {
  return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low)),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)));
}

__m512 halves_pair(const uint8_t* low, const uint8_t* high) {  // 8 fp16 of each group -> 16 fp32
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

// multiply_group for two consecutive groups (features [0, 8) from `group`, [8, features) from the next),
// lanes 0-7 the first group's and 8-15 the second's: per lane the same integer dot products and the same
// fp32 operations as multiply_group, so the same bits.
template <Format F>
void multiply_group_pair(const uint8_t* group, int64_t group_bytes, int64_t blocks, int64_t features,
                         const QuantizedRow* rows, int64_t count, float* y, int64_t stride) {
  constexpr int64_t bytes = F == kQ4_0 ? 16 + 128 : F == kQ4_1 ? 32 + 128 : 16 + 256;
  constexpr int64_t codes_at = F == kQ4_1 ? 32 : 16;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(-128);  // x ^ 0x80 = x + 128 as an unsigned byte
  constexpr int64_t kWideRowTile = 16;  // 32 registers: twice the rows share a block's decoded weights
  const int64_t per_tile = rows_per_tile(count, kWideRowTile);
  for (int64_t r0 = 0; r0 < count; r0 += per_tile) {
    const int64_t tile = std::min(per_tile, count - r0);
    __m512 acc[kWideRowTile];
    for (int64_t r = 0; r < kWideRowTile; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* low = group + b * bytes;
      const uint8_t* high = low + group_bytes;
      const __m512 d = halves_pair(low, high);
      __m512 m = _mm512_setzero_ps();
      if constexpr (F == kQ4_1) m = halves_pair(low + 16, high + 16);
      if constexpr (F == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      __m512i w[8];
      __m512i offset = _mm512_setzero_si512();  // Q8_0: 128 x each feature's sum of codes in this block
      for (int64_t j = 0; j < 8; ++j) {
        if constexpr (F == kQ8_0) {
          w[j] = load_pair(low + codes_at + j * 32, high + codes_at + j * 32);
          offset = _mm512_dpbusd_epi32(offset, _mm512_set1_epi8(-128), w[j]);  // unsigned 128 times each code
        } else {
          const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + codes_at + j * 16));
          const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + codes_at + j * 16));
          w[j] = join(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(a, 4), nibble), _mm_and_si128(a, nibble)),
                      _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), nibble), _mm_and_si128(c, nibble)));
        }
      }
      for (int64_t r = 0; r < tile; ++r) {
        const QuantizedRow& x = rows[r0 + r];
        const int8_t* xq = x.codes + b * kBlock;
        __m512i dot = _mm512_setzero_si512();
        for (int64_t j = 0; j < 8; ++j) {
          int32_t four;
          std::memcpy(&four, xq + j * 4, 4);
          const __m512i activations = _mm512_set1_epi32(four);
          if constexpr (F == kQ8_0)  // signed weights: x + 128 as the unsigned side, 128 sum(w) taken off below
            dot = _mm512_dpbusd_epi32(dot, _mm512_xor_si512(activations, flip), w[j]);
          else
            dot = _mm512_dpbusd_epi32(dot, w[j], activations);
        }
        if constexpr (F == kQ8_0) dot = _mm512_sub_epi32(dot, offset);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[b])), acc[r]);
        if constexpr (F != kQ8_0) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[b]), acc[r]);
      }
    }
    for (int64_t r = 0; r < tile; ++r) {
      alignas(64) float sums[2 * kTile];
      _mm512_store_ps(sums, acc[r]);
      std::copy(sums, sums + features, y + (r0 + r) * stride);
    }
  }
}
#endif

template <Format F>
void multiply(const uint8_t* weights, int64_t n, int64_t k, const QuantizedRow* rows, int64_t count, float* y) {
  const int64_t blocks = k / kBlock, group_bytes = blocks * group_block_bytes(F);
  at::parallel_for(0, (n + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end;) {
      const int64_t first = g * kTile;
      const uint8_t* group = weights + g * group_bytes;
#ifdef SPECMESH_AVX512
      constexpr int64_t step = 2;
#else
      constexpr int64_t step = 1;
#endif
#ifdef SPECMESH_AVX2
      if (g + step < end)  // streamed weights are never in cache: ask for the next groups' now
        for (int64_t i = 0; i < step * group_bytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(group + step * group_bytes + i), _MM_HINT_T0);
#endif
#ifdef SPECMESH_AVX512
      if (g + 1 < end) {
        multiply_group_pair<F>(group, group_bytes, blocks, std::min(2 * kTile, n - first), rows, count, y + first, n);
        g += 2;
        continue;
      }
#endif
      multiply_group<F>(group, blocks, std::min(kTile, n - first), rows, count, y + first, n);
      ++g;
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
              "block_linear: the weight must be contiguous uint8 [groups of 8 features, blocks, bytes] on the CPU");
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(k % kBlock == 0 && weight.size(1) == k / kBlock && weight.size(2) == group_block_bytes(format),
              "block_linear: x has ", k, " inputs; the weight has ", weight.size(1), " blocks of ", weight.size(2),
              " bytes (format ", format, " needs ", group_block_bytes(format), ")");
  TORCH_CHECK(n > (weight.size(0) - 1) * kTile && n <= weight.size(0) * kTile, "block_linear: ", n,
              " output features do not fill ", weight.size(0), " groups of 8");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;

  const int64_t blocks = k / kBlock;
  at::Tensor codes = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, rows, blocks}, x.options());
  std::vector<QuantizedRow> quantized(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* c = codes.data_ptr<int8_t>() + r * k;
    float* s = scales.data_ptr<float>() + r * blocks;
    float* sums = s + rows * blocks;
    quantize_row(input.data_ptr<float>() + r * k, k, c, s, sums);
    quantized[r] = {c, s, sums};
  }
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
