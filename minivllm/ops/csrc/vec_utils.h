// Loads and stores between float32 vectors and the model's dtype (float32 or bfloat16), shared
// by the CPU kernels. Rounding to bfloat16 is round-to-nearest-even, as torch's casts.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

namespace minivllm {

using Vec = at::vec::Vectorized<float>;

// n values of T from src as float32 vectors (n a multiple of 2 * Vec::size()).
template <typename T>
inline void load_floats(const T* src, Vec* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < n / Vec::size(); ++j) dst[j] = Vec::loadu(src + j * Vec::size());
  } else {
    using BVec = at::vec::Vectorized<T>;
    static_assert(BVec::size() == 2 * Vec::size());
    for (int64_t j = 0; j < n / BVec::size(); ++j) {
      auto [lo, hi] = at::vec::convert_to_float<T>(BVec::loadu(src + j * BVec::size()));
      dst[2 * j] = lo;
      dst[2 * j + 1] = hi;
    }
  }
}

template <typename T>
inline void store_floats(const Vec* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < n / Vec::size(); ++j) src[j].store(dst + j * Vec::size());
  } else {
    using BVec = at::vec::Vectorized<T>;
    for (int64_t j = 0; j < n / BVec::size(); ++j)
      at::vec::convert_from_float<T>(src[2 * j], src[2 * j + 1]).store(dst + j * BVec::size());
  }
}

// One pair of float32 vectors (2 * Vec::size() values) of T: the unit the kernels step by.
template <typename T>
inline void load_pair(const T* src, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(src);
    hi = Vec::loadu(src + Vec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
inline void store_pair(const Vec& lo, const Vec& hi, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// Rounds float32 values to T and back: the rounding a torch op producing T would apply.
template <typename T>
inline void round_pair(Vec& lo, Vec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

constexpr int64_t kPair = 2 * Vec::size();

// Query heads per KV head the attention kernels take (the decode kernel keeps one query vector
// set per head in registers).
constexpr int kMaxHeadsPerKv = 16;

}  // namespace minivllm
