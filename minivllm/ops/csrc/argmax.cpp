// The index of each row's largest value: the greedy sampler's token and the winner of the
// exponential race. torch's CPU argmax reduces element by element (3 ms for 64 rows of a 49k
// vocabulary on 2 cores); this one reads each row with vector max and compare, about 10x faster.
// Same answer as torch.argmax: the first index of the maximum, or of the first NaN if the row
// has one (NaN counts as the largest value).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "vec_utils.h"

namespace {

using minivllm::Vec;

int64_t row_argmax(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  const int64_t body = n / W * W;
  // Pass 1: the maximum; at::vec::maximum propagates NaN, so a NaN anywhere makes it NaN.
  float max = -INFINITY;
  if (body > 0) {
    Vec vmax = Vec::loadu(x);
    for (int64_t i = W; i < body; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(x + i));
    max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  }
  for (int64_t i = body; i < n; ++i) max = (std::isnan(x[i]) || x[i] > max) ? x[i] : max;
  if (std::isnan(max)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  // Pass 2: the first element equal to it (the row is in cache by now).
  const Vec vm(max);
  for (int64_t i = 0; i < body; i += W) {
    // zero_mask: a bit per lane whose comparison result is all-zero, i.e. not equal.
    const int not_equal = (Vec::loadu(x + i) == vm).zero_mask();
    const int equal = ~not_equal & ((1 << W) - 1);
    if (equal) return i + __builtin_ctz(equal);
  }
  for (int64_t i = body; i < n; ++i)
    if (x[i] == max) return i;
  return 0;  // n == 0 is refused by the caller
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: x must be a float32 [rows, n] tensor with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = row_argmax(data + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}
