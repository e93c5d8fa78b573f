// The index of a row's largest value, as torch.argmax gives it: the first index of the maximum,
// or of the first NaN if the row has one (NaN counts as the largest value). Shared by the
// sampler's argmax (argmax.cpp) and the exponential race (exponential_race.cpp).
#pragma once

#include <cmath>

#include "vec_utils.h"

namespace minivllm {

inline int64_t row_argmax(const float* x, int64_t n) {
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

}  // namespace minivllm
