// x @ W^T for the bfloat16 rows of a small step against a GGUF Q4_1 matrix kept as stored: W[n, k] =
// scale[n, k / 32] * q[n, k] + min[n, k / 32], codes q in [0, 16), float16 scale and min.
//
// A decode step reads every weight once for one or a few rows, so it should run at the speed
// memory streams the codes (20 bytes per 32 weights). Per block of 32 weights the kernel computes
// scale * (x . q) + min * sum(x) with AVX512-BF16's vdpbf16ps, which multiplies bfloat16 pairs and
// adds in float32. A code becomes a bfloat16 number with two integer operations: setting its
// 4 bits under the bits of 128.0 gives exactly 128 + q (bfloat16 steps by 1 in [128, 256)), and
// x . (128 + q) - 128 sum(x) = x . q. Every product is exact (x is bfloat16), scale and min are
// the file's, so the result is the exact product up to float32 sums and the final rounding to
// bfloat16. (Converting the codes to float32 for FMAs was compute-bound: round 4 of
// docs/perf-log.md.)
//
// The registers hold the accumulators of 8 rows; more rows are taken 8 at a time over each few
// tiles, which the first group reads from memory and the others from the cache, so a step of 9-32
// rows still moves the codes once (model/layers/quant.py: Q4_1_MAX_ROWS).
//
// Layout (model/layers/quant.py packs it): rows in tiles of 16; per tile and block of 32 columns,
// 4 units of 64 bytes, then the 16 scales and the 16 mins (float16). In unit u, the 16-bit word
// 2j + e holds q[row j, 8u + 2s + e] in bits 4s..4s+3 for s = 0..3. Nibble s of every word is one
// vector of (column 8u + 2s, 8u + 2s + 1) pairs for the 16 rows: vdpbf16ps against that pair of x
// broadcast leaves the 16 rows' partial dots in the 16 lanes, with no horizontal sums.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kUnits = 4;                                 // 64-byte loads of codes per block and tile
constexpr int64_t kBlockBytes = kUnits * 64 + 2 * kTile * 2;  // codes, then scales and mins
constexpr float kOffset = 128.f;
constexpr uint16_t kOffsetBits = 0x4300;  // bfloat16 128.0
constexpr int64_t kRowGroup = 8;     // rows whose accumulators fit the registers at once
constexpr int64_t kTilesPerPass = 4;  // tiles read once for all the groups of rows

inline __m512 broadcast_pair(const c10::BFloat16* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
}

// Outputs of tiles [t_begin, t_end) for M rows of x (row stride x_stride); xsum holds each row's
// block sums.
template <int M>
void tiles_kernel(const c10::BFloat16* x, int64_t x_stride, const float* xsum, int64_t k, const uint8_t* w,
                  c10::BFloat16* out, int64_t out_stride, int64_t t_begin, int64_t t_end) {
  // Independent accumulators per row, so that few rows do not wait on vdpbf16ps's latency.
  constexpr int NA = M == 1 ? 4 : (M <= 6 ? 2 : 1);
  const int64_t blocks = k / kBlock;
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i offset = _mm512_set1_epi16(static_cast<int16_t>(kOffsetBits));
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* wt = w + t * blocks * kBlockBytes;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = wt + b * kBlockBytes;
      __m512 part[M][NA];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < NA; ++a) part[m][a] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int u = 0; u < kUnits; ++u) {
        const __m512i words = _mm512_loadu_si512(wb + u * 64);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          // (word >> 4s) & 15 | 128.0's bits; 0xEA is (A & B) | C in vpternlog's truth table.
          const __m512bh codes = (__m512bh)_mm512_ternarylogic_epi32(
              s == 0 ? words : _mm512_srli_epi16(words, 4 * s), nibble, offset, 0xEA);
          for (int m = 0; m < M; ++m) {
            const __m512bh pair = (__m512bh)broadcast_pair(x + m * x_stride + b * kBlock + 8 * u + 2 * s);
            part[m][s % NA] = _mm512_dpbf16_ps(part[m][s % NA], codes, pair);
          }
        }
      }
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kUnits * 64)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kUnits * 64 + 32)));
      for (int m = 0; m < M; ++m) {
        __m512 dot = part[m][0];
        for (int a = 1; a < NA; ++a) dot = _mm512_add_ps(dot, part[m][a]);
        const float sum = xsum[m * blocks + b];
        dot = _mm512_sub_ps(dot, _mm512_set1_ps(kOffset * sum));
        acc[m] = _mm512_fmadd_ps(scale, dot, acc[m]);
        acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sum), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + t * kTile),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

// Sums of each block of 32 values of one bfloat16 row.
void block_sums(const c10::BFloat16* x, int64_t blocks, float* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i raw = _mm512_loadu_si512(x + b * kBlock);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// Tiles [t_begin, t_end) for `rows` (1..kRowGroup) rows of x.
void tiles_of_rows(int64_t rows, const c10::BFloat16* x, int64_t x_stride, const float* xsum, int64_t k,
                   const uint8_t* w, c10::BFloat16* out, int64_t out_stride, int64_t t_begin, int64_t t_end) {
  switch (rows) {
    case 1: tiles_kernel<1>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 2: tiles_kernel<2>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 3: tiles_kernel<3>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 4: tiles_kernel<4>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 5: tiles_kernel<5>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 6: tiles_kernel<6>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    case 7: tiles_kernel<7>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
    default: tiles_kernel<8>(x, x_stride, xsum, k, w, out, out_stride, t_begin, t_end); break;
  }
}

// More rows than one group's accumulators hold: each few tiles are read from memory once and
// serve every group of rows from the cache (kTilesPerPass tiles of a 1536-column matrix: 60 KB).
void run(int64_t m, const c10::BFloat16* x, int64_t x_stride, const float* xsum, int64_t k, const uint8_t* w,
         c10::BFloat16* out, int64_t tiles) {
  const int64_t blocks = k / kBlock, out_stride = tiles * kTile;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += kTilesPerPass) {
      const int64_t t_end = std::min(end, t + kTilesPerPass);
      for (int64_t r = 0; r < m; r += kRowGroup)
        tiles_of_rows(std::min(kRowGroup, m - r), x + r * x_stride, x_stride, xsum + r * blocks, k, w,
                      out + r * out_stride, out_stride, t, t_end);
    }
  });
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be bfloat16 [M, K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
              k % kBlock == 0 && weight.size(1) == k / kBlock && weight.size(2) == kBlockBytes,
              "weight must be uint8 [N / 16, K / 32, ", kBlockBytes, "] for x of ", k, " columns, got ",
              weight.sizes());
  const int64_t tiles = weight.size(0), blocks = k / kBlock;
  at::Tensor out = at::empty({m, tiles * kTile}, x.options());
  if (m == 0) return out;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  std::vector<float> xsum(m * blocks);
  for (int64_t r = 0; r < m; ++r) block_sums(xp + r * xs, blocks, xsum.data() + r * blocks);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  auto* o = out.data_ptr<c10::BFloat16>();
  run(m, xp, xs, xsum.data(), k, w, o, tiles);
  return out;
}

}  // namespace

// Registered only where the build has AVX512-BF16 (it is -march=native); elsewhere Q4_1 layers
// take torch's int4 kernel (model/layers/quant.py).
TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, &q4_1_linear);
}

#endif
