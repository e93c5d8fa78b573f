// Rotary position embedding (rotate-half / GPT-NeoX style) applied in place to the query and
// key heads of a step, each token at its own position. The tables hold, per position, cos twice
// and sin with rotate-half's sign folded in ([-sin, sin]); every product and the sum are
// rounded to the model dtype, as transformers' q * cos + rotate_half(q) * sin is:
//   x1' = round(round(x1 * cos) + round(x2 * -sin)),  x2' = round(round(x2 * cos) + round(x1 * sin))

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec_utils.h"

namespace {

using minivllm::kPair;
using minivllm::Vec;

constexpr int64_t kMaxHeadDim = 256;

template <typename T>
inline void rotate_head(T* x, const Vec* cos, const Vec* sin, int64_t half) {
  // Both halves are read before either is written: the rotation mixes them.
  for (int64_t i = 0; i < half; i += kPair) {
    Vec a_lo, a_hi, b_lo, b_hi;
    minivllm::load_pair(x + i, a_lo, a_hi);
    minivllm::load_pair(x + half + i, b_lo, b_hi);
    const int64_t j = i / Vec::size(), k = (half + i) / Vec::size();
    Vec p_lo = a_lo * cos[j], p_hi = a_hi * cos[j + 1];
    Vec q_lo = b_lo * sin[j], q_hi = b_hi * sin[j + 1];
    Vec r_lo = b_lo * cos[k], r_hi = b_hi * cos[k + 1];
    Vec s_lo = a_lo * sin[k], s_hi = a_hi * sin[k + 1];
    minivllm::round_pair<T>(p_lo, p_hi);
    minivllm::round_pair<T>(q_lo, q_hi);
    minivllm::round_pair<T>(r_lo, r_hi);
    minivllm::round_pair<T>(s_lo, s_hi);
    minivllm::store_pair(p_lo + q_lo, p_hi + q_hi, x + i);
    minivllm::store_pair(r_lo + s_lo, r_hi + s_hi, x + half + i);
  }
}

template <typename T>
void rotary_embedding_impl(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  const int64_t num_tokens = query.size(0), head_dim = query.size(2), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_base = cos_cache.data_ptr<float>();
  const float* sin_base = sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    Vec cos[kMaxHeadDim / 16], sin[kMaxHeadDim / 16];
    for (int64_t t = begin; t < end; ++t) {
      // The tables are float32; transformers casts them to the model dtype before use.
      for (int64_t i = 0; i < head_dim; i += kPair) {
        const int64_t j = i / Vec::size();
        minivllm::load_pair(cos_base + pos[t] * head_dim + i, cos[j], cos[j + 1]);
        minivllm::load_pair(sin_base + pos[t] * head_dim + i, sin[j], sin[j + 1]);
        minivllm::round_pair<T>(cos[j], cos[j + 1]);
        minivllm::round_pair<T>(sin[j], sin[j + 1]);
      }
      for (at::Tensor* x : {&query, &key}) {
        T* row = x->data_ptr<T>() + t * x->stride(0);
        for (int64_t h = 0; h < x->size(1); ++h) rotate_head<T>(row + h * x->stride(1), cos, sin, half);
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "query and key must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key.size(2) == head_dim && key.size(0) == query.size(0) &&
              positions.size(0) == query.size(0), "query, key and positions disagree");
  TORCH_CHECK(head_dim % (2 * kPair) == 0 && head_dim <= kMaxHeadDim,
              "head_dim must be a multiple of ", 2 * kPair, " up to ", kMaxHeadDim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
              cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
              cos_cache.size(1) == head_dim && sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin tables must be float32 [max_position, head_dim]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type());
  switch (query.scalar_type()) {
    case at::kFloat: return rotary_embedding_impl<float>(positions, query, key, cos_cache, sin_cache);
    case at::kBFloat16: return rotary_embedding_impl<c10::BFloat16>(positions, query, key, cos_cache, sin_cache);
    default: TORCH_CHECK(false, "rotary_embedding: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, "
        "Tensor sin_cache) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
}
