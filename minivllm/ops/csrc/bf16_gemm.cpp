// x @ W^T for bfloat16 x and W, multiplied and summed in float32 with float32 FMAs.
//
// Why not oneDNN's bfloat16 GEMM: on CPUs whose bfloat16 dot product (vdpbf16ps) issues on one
// port while float32 FMAs issue on two (Intel's AVX-512 cores without AMX), it reaches half of
// what float32 does: 130-160 GFLOP/s against 250-300 on a 2-core Xeon. Converting the weight to
// float32 would double the bytes every decode step reads. Here the weight stays bfloat16 and is
// widened in registers: a bfloat16 is the top half of a float32, so one shift (or one mask)
// makes 16 float32 of it. The platform times both once and keeps the faster
// (platforms/cpu_gemm.py); CPUs with a fast vdpbf16ps (Zen 4) keep oneDNN.
//
// Layout (bf16_pack_weight): W [N, K] as panels of 32 output columns, [N / 32][K][32], where the
// 32-bit lane j of row k holds column j in its low half and column 16 + j in its high half, so one
// 64-byte load gives both 16-column vectors: lane << 16 and lane & 0xffff0000.
// Products are exact in float32 (8-bit mantissas); only the order of the sums differs from
// oneDNN's, and the result is rounded to bfloat16 once, to nearest even.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per packed panel
constexpr int kRows = 12;       // rows of x per tile: 24 accumulators, 2 weight vectors, 1 mask
constexpr int64_t kChunkTiles = 8;  // row tiles that go over a thread's panels together
constexpr int64_t kDepth = 256;     // columns of K per pass: a panel's 16 KiB of them fit in L1

at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack_weight: a 2-D bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "bf16_pack_weight: ", n, " output rows, not a multiple of ", kPanel);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kPanel, k, kPanel}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const uint16_t* row = src + (p * kPanel + c) * k;
        // Column c < 16 goes to lane c's low half, column 16 + j to lane j's high half.
        uint16_t* out = dst + p * k * kPanel + (c < 16 ? 2 * c : 2 * (c - 16) + 1);
        for (int64_t i = 0; i < k; ++i) out[i * kPanel] = row[i];
      }
    }
  });
  return packed;
}

#if defined(__AVX512F__)

inline void store_row(const __m512& lo, const __m512& hi, const float* bias, at::BFloat16* out) {
  __m512 a = lo, b = hi;
  if (bias != nullptr) {
    a = _mm512_add_ps(a, _mm512_loadu_ps(bias));
    b = _mm512_add_ps(b, _mm512_loadu_ps(bias + 16));
  }
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(b));
#else
  alignas(64) float values[kPanel];
  _mm512_store_ps(values, a);
  _mm512_store_ps(values + 16, b);
  for (int64_t j = 0; j < kPanel; ++j) out[j] = at::BFloat16(values[j]);  // to nearest even
#endif
}

// R rows of x (float32, packed by pack_rows: row r of column i at a[i * kRows + r]) times one
// panel, over columns [k0, k1) of K. The sums so far live in `partial` (R x 32 float32) between
// depth chunks; the last chunk adds the bias and writes bfloat16.
template <int R>
inline void tile(const float* a, const uint32_t* b, int64_t k0, int64_t k1, float* partial, const float* bias,
                 at::BFloat16* out, int64_t ldc, bool last) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * kPanel);
    acc[r][1] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * kPanel + 16);
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = k0; i < k1; ++i) {
    const __m512i w = _mm512_loadu_si512(b + i * (kPanel / 2));
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[i * kRows + r]);
      acc[r][0] = _mm512_fmadd_ps(x, lo, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, hi, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (last) {
      store_row(acc[r][0], acc[r][1], bias, out + r * ldc);
    } else {
      _mm512_storeu_ps(partial + r * kPanel, acc[r][0]);
      _mm512_storeu_ps(partial + r * kPanel + 16, acc[r][1]);
    }
  }
}

template <int R>
void tail_tile(const float* a, const uint32_t* b, int64_t k0, int64_t k1, float* partial, const float* bias,
               at::BFloat16* out, int64_t ldc, bool last, int rows) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(a, b, k0, k1, partial, bias, out, ldc, last);
    tail_tile<R - 1>(a, b, k0, k1, partial, bias, out, ldc, last, rows);
  }
}

// Rows [row0, row0 + rows) of x (bfloat16, K columns) as float32 tiles of kRows rows,
// [tiles][K][kRows], so that a tile reads one stream (its rows' values of column i side by side)
// instead of kRows. Written in order; a bfloat16's bits are the top half of its float32's. Rows
// past the end are left as they are: no output reads them.
void pack_rows(const at::BFloat16* x, int64_t k, int64_t row0, int64_t rows, float* dst) {
  const auto* src = reinterpret_cast<const uint16_t*>(x) + row0 * k;
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t t = 0; t * kRows < rows; ++t) {
    const int64_t tile_rows = std::min<int64_t>(kRows, rows - t * kRows);
    const uint16_t* tile_src = src + t * kRows * k;
    uint32_t* tile_dst = out + t * k * kRows;
    for (int64_t i = 0; i < k; ++i)
      for (int64_t r = 0; r < tile_rows; ++r) tile_dst[i * kRows + r] = static_cast<uint32_t>(tile_src[r * k + i]) << 16;
  }
}

struct Gemm {
  const float* bias;  // float32, n values; nullptr: none
  const uint32_t* weight;
  at::BFloat16* out;
  int64_t n, k;

  // Packed rows [row0, row0 + rows) (at most kChunkTiles tiles) times panels [p0, p1), each
  // panel kDepth columns of K at a time: the panel's chunk stays in L1 across the tiles, the
  // tiles' rows in L2 across the panels.
  void run(const float* a, int64_t row0, int64_t rows, int64_t p0, int64_t p1, float* partial) const {
    const int64_t tiles = (rows + kRows - 1) / kRows;
    for (int64_t p = p0; p < p1; ++p) {
      const uint32_t* panel = weight + p * k * (kPanel / 2);
      const float* pb = bias == nullptr ? nullptr : bias + p * kPanel;
      for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
        const int64_t k1 = std::min(k, k0 + kDepth);
        for (int64_t t = 0; t < tiles; ++t) {
          const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, rows - t * kRows));
          const float* at = a + t * k * kRows;
          float* pt = partial + t * kRows * kPanel;
          at::BFloat16* ct = out + (row0 + t * kRows) * n + p * kPanel;
          if (tile_rows == kRows) {
            tile<kRows>(at, panel, k0, k1, pt, pb, ct, n, k1 == k);
          } else {
            tail_tile<kRows - 1>(at, panel, k0, k1, pt, pb, ct, n, k1 == k, tile_rows);
          }
        }
      }
    }
  }
};

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
              packed.size(2) == kPanel, "bf16_gemm: bfloat16 x and a weight from bf16_pack_weight");
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kPanel;
  TORCH_CHECK(x.size(-1) == k, "bf16_gemm: x has ", x.size(-1), " columns, the weight ", k);
  const at::Tensor x2d = x.reshape({-1, k}).contiguous();
  const int64_t m = x2d.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bf16_gemm: bias of ", bias->numel(), " values for ", n, " columns");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return out;
  const Gemm gemm{bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                  reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), out.data_ptr<at::BFloat16>(), n, k};
  const at::BFloat16* xp = x2d.data_ptr<at::BFloat16>();
  constexpr int64_t kChunkRows = kChunkTiles * kRows;
  if (m < 2 * kChunkRows) {
    // Few rows (decode steps, short prompts): the threads split the panels, so each reads its
    // share of the weight once; the rows are packed once and shared.
    std::vector<float> a(((m + kRows - 1) / kRows) * kRows * k);
    pack_rows(xp, k, 0, m, a.data());
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> partial(kChunkRows * kPanel);
      for (int64_t row0 = 0; row0 < m; row0 += kChunkRows)
        gemm.run(a.data() + row0 * k, row0, std::min(kChunkRows, m - row0), p0, p1, partial.data());
    });
  } else {
    // Many rows (prompts): the threads split the rows, each packing its chunks into a buffer
    // that stays in its L2, and every thread reads the whole weight (from cache, mostly). The
    // chunks are as even as whole tiles allow, a whole number per thread.
    const int64_t threads = at::get_num_threads();
    const int64_t chunks = ((m + kChunkRows - 1) / kChunkRows + threads - 1) / threads * threads;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> a(chunk_rows * k), partial(chunk_rows * kPanel);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t row0 = c * chunk_rows, rows = std::min(chunk_rows, m - row0);
        if (rows <= 0) break;
        pack_rows(xp, k, row0, rows, a.data());
        gemm.run(a.data(), row0, rows, 0, panels, partial.data());
      }
    });
  }
  return out;
}

#endif  // __AVX512F__

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.impl("bf16_pack_weight", c10::DispatchKey::CPU, &bf16_pack_weight);
#if defined(__AVX512F__)
  // Defined only where it is compiled: the platform offers it only when the op exists.
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("bf16_gemm", c10::DispatchKey::CPU, &bf16_gemm);
#endif
}
