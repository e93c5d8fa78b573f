// SiLU-and-multiply of the fused gate/up projection: out = round(round(silu(gate)) * up), with
// silu(x) = x / (1 + exp(-x)) exactly as torch's CPU silu computes it, so the result equals
// transformers' act_fn(gate) * up bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec_utils.h"

namespace {

using minivllm::kPair;
using minivllm::Vec;

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t d = out.size(1), rows = out.size(0);
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const Vec one(1.f);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * x.stride(0);
      const T* up = gate + d;
      T* dst = o + r * out.stride(0);
      for (int64_t i = 0; i < d; i += kPair) {
        Vec g_lo, g_hi, u_lo, u_hi;
        minivllm::load_pair(gate + i, g_lo, g_hi);
        minivllm::load_pair(up + i, u_lo, u_hi);
        g_lo = g_lo / (one + g_lo.neg().exp());
        g_hi = g_hi / (one + g_hi.neg().exp());
        minivllm::round_pair<T>(g_lo, g_hi);
        minivllm::store_pair(g_lo * u_lo, g_hi * u_hi, dst + i);
      }
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "x [tokens, 2 * d] and out [tokens, d] with contiguous rows");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1), "x must be [tokens, 2 * d]");
  TORCH_CHECK(out.size(1) % kPair == 0, "d must be a multiple of ", kPair);
  TORCH_CHECK(x.scalar_type() == out.scalar_type());
  switch (x.scalar_type()) {
    case at::kFloat: return silu_and_mul_impl<float>(out, x);
    case at::kBFloat16: return silu_and_mul_impl<c10::BFloat16>(out, x);
    default: TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}
