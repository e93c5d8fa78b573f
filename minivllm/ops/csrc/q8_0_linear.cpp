// x @ W^T for a few rows of x against a GGUF Q8_0 matrix kept as stored: W[n, k] =
// scale[n, k / 32] * q[n, k] with int8 codes and float16 scales. The products and sums are in
// float32, so the result uses the file's exact weights (a bfloat16 copy of W would round them)
// while reading a quarter of the bytes of float32 (half of bfloat16): for the lm_head of a small
// model, the largest matrix a decode step reads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

#include "vec_utils.h"

namespace {

using minivllm::Vec;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;

// The 32 codes of one block as float32 vectors (Vec::size() values each).
inline void load_codes(const int8_t* q, Vec* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
#else
  float tmp[kBlock];
  for (int64_t i = 0; i < kBlock; ++i) tmp[i] = static_cast<float>(q[i]);
  for (int64_t j = 0; j < kBlock / Vec::size(); ++j) out[j] = Vec::loadu(tmp + j * Vec::size());
#endif
}

template <int M>
void rows_kernel(const float* x, int64_t k, const int8_t* q, const c10::Half* scales, float* out,
                 int64_t out_stride, int64_t n_begin, int64_t n_end) {
  constexpr int NV = kBlock / Vec::size();
  const int64_t blocks = k / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* qn = q + n * k;
    const c10::Half* sn = scales + n * blocks;
    Vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = Vec(0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      Vec codes[NV];
      load_codes(qn + b * kBlock, codes);
      const Vec d(static_cast<float>(sn[b]));
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * k + b * kBlock;
        Vec dot = codes[0] * Vec::loadu(xb);
        for (int j = 1; j < NV; ++j) dot = at::vec::fmadd(codes[j], Vec::loadu(xb + j * Vec::size()), dot);
        acc[m] = at::vec::fmadd(d, dot, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * out_stride + n] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m]);
  }
}

template <int M>
void run(const float* x, int64_t k, const int8_t* q, const c10::Half* scales, float* out,
         int64_t out_stride, int64_t n) {
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    rows_kernel<M>(x, k, q, scales, out, out_stride, begin, end);
  });
}

void q8_0_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2, "x, qweight, scales must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(m <= kMaxRows, "q8_0_linear takes at most ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(qweight.size(1) == k && k % kBlock == 0 && qweight.scalar_type() == at::kChar &&
              qweight.is_contiguous(), "qweight must be int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == n &&
              scales.size(1) == k / kBlock, "scales must be float16 [N, K / 32]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.size(0) == m && out.size(1) == n &&
              out.stride(1) == 1, "out must be float32 [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  if (m == 0) return;
  // The few rows of x, in float32 and contiguous, shared by every thread.
  std::vector<float> xf(m * k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t idx = r * x.stride(0) + i * x.stride(1);
      xf[r * k + i] = x.scalar_type() == at::kBFloat16
          ? static_cast<float>(static_cast<const c10::BFloat16*>(x.data_ptr())[idx])
          : static_cast<const float*>(x.data_ptr())[idx];
    }
  }
  const int8_t* q = qweight.data_ptr<int8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  float* o = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  switch (m) {
    case 1: return run<1>(xf.data(), k, q, s, o, os, n);
    case 2: return run<2>(xf.data(), k, q, s, o, os, n);
    case 3: return run<3>(xf.data(), k, q, s, o, os, n);
    case 4: return run<4>(xf.data(), k, q, s, o, os, n);
    case 5: return run<5>(xf.data(), k, q, s, o, os, n);
    case 6: return run<6>(xf.data(), k, q, s, o, os, n);
    case 7: return run<7>(xf.data(), k, q, s, o, os, n);
    default: return run<8>(xf.data(), k, q, s, o, os, n);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("q8_0_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales) -> ()");
  m.impl("q8_0_linear", c10::DispatchKey::CPU, &q8_0_linear);
}
