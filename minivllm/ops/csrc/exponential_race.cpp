// The sampler's random draw: the exponential race, argmax_i p_i / E_i with E_i ~ Exp(1), an
// exact draw from each row's distribution p. torch's CPU exponential_ fills q on one thread at
// ~20 ns a value: ~1 ms a row of a 49k vocabulary, as much as the rest of a decode row costs.
// Here each E_i comes from a counter-based generator, so a row needs one seed and no state: the
// i-th output of SplitMix64 started at the row's seed, its top 23 bits a uniform
// u = (k + 0.5) / 2^23, exact in float32 and never 0 or 1 (with 24 bits, k + 0.5 rounds and the
// top code gave u = 1, E = 0, and a zero-probability token won with 0 / 0), E = -log(u). The draws are made, raced and reduced a block
// at a time in vector registers; q is never written. The race's winner is the argmax of the
// ratios with torch.argmax's contract (row_argmax.h): a NaN probability wins, as it would in
// argmax(p / q).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "row_argmax.h"

namespace {

using minivllm::Vec;

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment
constexpr int64_t kBlock = 512;                     // values drawn and raced at a time

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// p_i / E_i for i in [start, start + len) into out; the generator's state before draw i is
// seed + i * kGamma, so draw i is splitmix64(seed + (i + 1) * kGamma).
void race_block(const float* p, uint64_t seed, int64_t start, int64_t len, float* out) {
  for (int64_t j = 0; j < len; ++j) {  // vectorised by the compiler (64-bit lanes)
    const uint64_t z = splitmix64(seed + static_cast<uint64_t>(start + j + 1) * kGamma);
    out[j] = (static_cast<float>(z >> 41) + 0.5f) * 0x1p-23f;
  }
  constexpr int64_t W = Vec::size();
  const int64_t body = len / W * W;
  for (int64_t j = 0; j < body; j += W) {
    const Vec e = Vec(0.0f) - Vec::loadu(out + j).log();
    (Vec::loadu(p + j) / e).store(out + j);
  }
  for (int64_t j = body; j < len; ++j) out[j] = p[j] / -std::log(out[j]);
}

int64_t race_row(const float* p, int64_t n, uint64_t seed) {
  float ratios[kBlock];
  float best = -INFINITY;
  int64_t winner = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    race_block(p + start, seed, start, len, ratios);
    const int64_t j = minivllm::row_argmax(ratios, len);
    if (std::isnan(ratios[j])) return start + j;
    if (ratios[j] > best) {  // strictly: on a tie the earlier block keeps it, as argmax would
      best = ratios[j];
      winner = start + j;
    }
  }
  return winner;
}

at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& seeds) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1,
              "exponential_race: probs must be a float32 [rows, n] tensor with contiguous rows");
  TORCH_CHECK(probs.size(1) > 0, "exponential_race: rows must not be empty");
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong && seeds.size(0) == probs.size(0) &&
                  seeds.is_contiguous(),
              "exponential_race: seeds must be a contiguous int64 tensor with one seed per row");
  const int64_t rows = probs.size(0), n = probs.size(1), stride = probs.stride(0);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* data = probs.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = race_row(data + r * stride, n, static_cast<uint64_t>(seed[r]));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("exponential_race(Tensor probs, Tensor seeds) -> Tensor");
  m.impl("exponential_race", c10::DispatchKey::CPU, &exponential_race);
}
