// The index of each row's largest value: the greedy sampler's token and the winner of the
// exponential race. torch's CPU argmax reduces element by element (3 ms for 64 rows of a 49k
// vocabulary on 2 cores); this one reads each row with vector max and compare, about 10x faster.
// Same answer as torch.argmax: the first index of the maximum, or of the first NaN if the row
// has one (NaN counts as the largest value).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>


#include "row_argmax.h"

namespace {

using minivllm::row_argmax;

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
