// RMSNorm, alone and with the residual add folded in, with the roundings of transformers'
// LlamaRMSNorm: the normalised value is rounded to the model dtype before the weight multiply.
//   rms_norm:           out = round(round(x * rsqrt(mean(x^2) + eps)) * w)
//   fused_add_rms_norm: residual = round(x + residual); x = rms_norm(residual)   (in place)
// With gemma=true, those of Gemma3RMSNorm: the weight is stored as w and scales by 1 + w, in
// float32 before the one rounding: out = round(x * rsqrt(mean(x^2) + eps) * (1 + w)).
// One pass reads a row into registers' worth of float32 and writes it once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "vec_utils.h"

namespace {

using minivllm::kPair;
using minivllm::Vec;

// Normalises one row of n values (n a multiple of kPair) from `src` (float32 copy) into out.
template <typename T, bool kGemma>
inline void normalize_row(const float* src, const T* weight, T* out, int64_t n, float eps) {
  Vec sq(0.f);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    Vec v = Vec::loadu(src + i);
    sq = at::vec::fmadd(v, v, sq);
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
  const Vec inv(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kPair) {
    Vec lo = Vec::loadu(src + i) * inv, hi = Vec::loadu(src + i + Vec::size()) * inv;
    Vec w_lo, w_hi;
    minivllm::load_pair(weight + i, w_lo, w_hi);
    if constexpr (kGemma) {
      w_lo = w_lo + Vec(1.f);
      w_hi = w_hi + Vec(1.f);
    } else {
      minivllm::round_pair<T>(lo, hi);
    }
    minivllm::store_pair(lo * w_lo, hi * w_hi, out + i);
  }
}

// Row r of a 2-D or 3-D tensor whose last dimension is contiguous.
template <typename T>
inline T* row_ptr(const at::Tensor& t, int64_t r) {
  T* base = static_cast<T*>(t.data_ptr());
  if (t.dim() == 2) return base + r * t.stride(0);
  return base + (r / t.size(1)) * t.stride(0) + (r % t.size(1)) * t.stride(1);
}

void check_rows(const at::Tensor& t, const at::Tensor& weight, const char* name) {
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, name,
              " must be 2-D or 3-D with a contiguous last dimension");
  TORCH_CHECK(t.size(-1) == weight.size(0) && weight.is_contiguous() &&
              t.scalar_type() == weight.scalar_type(), name, " and weight disagree");
  TORCH_CHECK(t.size(-1) % kPair == 0, "hidden size must be a multiple of ", kPair);
}

template <typename T, bool kGemma>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps,
                   at::Tensor* residual) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = row_ptr<T>(x, r);
      for (int64_t i = 0; i < n; i += kPair) {
        Vec lo, hi;
        minivllm::load_pair(xr + i, lo, hi);
        if (residual != nullptr) {
          T* rr = row_ptr<T>(*residual, r);
          Vec r_lo, r_hi;
          minivllm::load_pair(rr + i, r_lo, r_hi);
          lo = lo + r_lo;
          hi = hi + r_hi;
          minivllm::round_pair<T>(lo, hi);
          minivllm::store_pair(lo, hi, rr + i);
        }
        lo.store(buf.data() + i);
        hi.store(buf.data() + i + Vec::size());
      }
      normalize_row<T, kGemma>(buf.data(), w, row_ptr<T>(out, r), n, eps);
    }
  });
}

template <typename Fn>
void dispatch(const at::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    default: TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
}

template <typename T>
void rms_norm_any(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                  at::Tensor* residual, bool gemma) {
  if (gemma) return rms_norm_impl<T, true>(out, x, weight, eps, residual);
  rms_norm_impl<T, false>(out, x, weight, eps, residual);
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check_rows(x, weight, "x");
  check_rows(out, weight, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be shaped like x");
  dispatch(x, [&](auto t) { rms_norm_any<decltype(t)>(out, x, weight, eps, nullptr, gemma); });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps, bool gemma) {
  check_rows(x, weight, "x");
  check_rows(residual, weight, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must be shaped like x");
  dispatch(x, [&](auto t) { rms_norm_any<decltype(t)>(x, x, weight, eps, &residual, gemma); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool gemma=False) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, bool gemma=False) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
}
