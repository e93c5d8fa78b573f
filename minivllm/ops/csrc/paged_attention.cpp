// Paged attention on the CPU: one query token per request against its K/V read straight from the
// cache blocks named by its block table (no gathered copy), and the cache write of a step's new
// K/V. Built and loaded as torch.ops.minivllm_cpu.* by minivllm/ops/cpu_kernels.py.
//
// Cache layout per layer (the CPU backend's get_kv_cache_shape):
//   [2, num_kv_heads, num_blocks, block_size, head_dim]; index 0 holds keys, 1 values.
// Each work item is one (request, KV head): the query heads sharing that KV head are scored
// together, so every cached key and value is read once per step. With a sliding window W, a
// request reads only its last W keys (positions seq_len - W .. seq_len - 1): the blocks before
// them may already be back in the pool, holding another request's K/V.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_utils.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using minivllm::kMaxHeadsPerKv;
using minivllm::Vec;

// The cached rows of one KV head in token order from position `first`, each pointing at its
// head_dim values, walked block by block through the block table (no division per token). Blocks lie scattered over
// the cache, where the hardware prefetcher loses the stream at every block boundary, so each
// row asks for the same row of the next block: a rolling distance of one block. Asking for a
// whole block at the boundary instead overflows the core's miss buffers (64 requests x 400
// tokens x 30 layers, blocks of 16 shuffled: 107-111 ms that way, 67-71 rolling; contiguous
// blocks unchanged). A walker rather than a callback: the passes keep their accumulators in
// registers (captured by a callback, they lived on the stack).
template <typename T, int D>
class RowWalker {
 public:
  RowWalker(const T* cache, const int32_t* block_ids, int64_t first, int64_t seq_len, int64_t block_size)
      : cache_(cache), block_ids_(block_ids), block_size_(block_size),
        num_blocks_((seq_len + block_size - 1) / block_size) {
    if (first < seq_len) {
      enter(first / block_size);
      i_ = first % block_size;
    }
  }

  // The next row: call it at most seq_len - first times.
  __attribute__((always_inline)) const T* next() {
    if (i_ == block_size_) enter(b_ + 1);
    if (next_block_ != nullptr)
      for (size_t off = 0; off < kRowBytes; off += 64) __builtin_prefetch(next_block_ + i_ * kRowBytes + off);
    return block_ + (i_++) * D;
  }

 private:
  static constexpr size_t kRowBytes = D * sizeof(T);

  __attribute__((always_inline)) void enter(int64_t b) {
    b_ = b;
    i_ = 0;
    block_ = cache_ + block_ids_[b] * block_size_ * D;
    next_block_ = b + 1 < num_blocks_
                      ? reinterpret_cast<const char*>(cache_ + block_ids_[b + 1] * block_size_ * D)
                      : nullptr;
  }

  const T* cache_;
  const int32_t* block_ids_;
  int64_t block_size_, num_blocks_;
  int64_t b_ = 0, i_ = 0;
  const T* block_ = nullptr;
  const char* next_block_ = nullptr;
};

// Softmax of scores[0:n] in place, in float32.
inline void softmax_inplace(float* scores, int64_t n) {
  float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                         scores, n);
  const Vec vmax(max);
  int64_t t = 0;
  Vec vsum(0.f);
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec e = (Vec::loadu(scores + t) - vmax).exp_u20();
    e.store(scores + t);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
  at::vec::map([inv](Vec x) { return x * Vec(inv); }, scores, scores, n);
}

constexpr int kKeysPerSum = 4;  // keys scored together, their dot products summed in one go

// dst[r] = the sum of the lanes of acc[r] for r < n (n <= kKeysPerSum). On AVX-512 one
// transposing reduction serves four keys: a horizontal sum per key and head (~8 dependent
// shuffles and adds, then a scalar store) was the largest part of the key pass.
inline void sum_lanes(const Vec (&acc)[kKeysPerSum], float* dst, int n) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 half[kKeysPerSum];
  for (int r = 0; r < kKeysPerSum; ++r) {
    const __m512 a = acc[r];
    half[r] = _mm256_add_ps(_mm512_castps512_ps256(a),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  // Lane r of each 128-bit half: key r's partial sums, then the two halves added.
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
  const __m128 total = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
  if (n == kKeysPerSum) {
    _mm_storeu_ps(dst, total);
  } else {
    alignas(16) float all[kKeysPerSum];
    _mm_store_ps(all, total);
    std::copy(all, all + n, dst);
  }
#else
  for (int r = 0; r < n; ++r)
    dst[r] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r]);
#endif
}

// Vector accumulators a pass keeps in registers (AVX-512 has 32 vector registers; the rest hold
// the row being read and the queries or probabilities).
constexpr int kAccumulators = 16;
constexpr int kHeadsPerGroup = kAccumulators / kKeysPerSum;  // query heads a key step scores

// Float vectors of head_dim one value walk covers: as many as leave `heads` x that many
// accumulators in registers, a power of two and at least a pair (the unit bfloat16 loads in).
constexpr int value_slice(int heads, int nv) {
  int slice = 2;
  while (slice * 2 <= nv && heads * slice * 2 <= kAccumulators) slice *= 2;
  return slice;
}

// Attention of `heads` query heads (rows of q, `q_stride` apart) over one KV head's cached
// tokens first .. seq_len - 1; scores is scratch of heads * (seq_len - first) floats. Both passes keep their
// accumulators in registers: the key pass scores kKeysPerSum keys for up to kHeadsPerGroup
// heads at a time, the value pass walks the rows once per slice of head_dim that fits. Only
// the instances with a known head count can: the generic one (kHeads 0) spills.
template <typename T, int D, int kHeads>
void attend_kv_head(const T* q, int64_t q_stride, int heads_rt, const T* key_cache,
                    const T* value_cache, const int32_t* block_ids, int64_t first, int64_t end,
                    int64_t block_size, float scale, T* out, int64_t out_stride, float* scores) {
  const int64_t seq_len = end - first;  // keys read
  constexpr int NV = D / Vec::size();
  constexpr int G = kHeads > 0 ? kHeads : kMaxHeadsPerKv;
  const int heads = kHeads > 0 ? kHeads : heads_rt;
  Vec qv[G][NV];
  for (int g = 0; g < heads; ++g) {
    minivllm::load_floats(q + g * q_stride, qv[g], D);
    for (int j = 0; j < NV; ++j) qv[g][j] = qv[g][j] * Vec(scale);
  }
  RowWalker<T, D> keys(key_cache, block_ids, first, end, block_size);
  const T* row = nullptr;
  for (int64_t t0 = 0; t0 < seq_len; t0 += kKeysPerSum) {
    const int n = static_cast<int>(std::min<int64_t>(kKeysPerSum, seq_len - t0));
    const T* rows[kKeysPerSum];
    for (int r = 0; r < kKeysPerSum; ++r) {
      if (r < n) row = keys.next();  // past the last key its row is scored again, not stored
      rows[r] = row;
    }
    for (int g0 = 0; g0 < heads; g0 += kHeadsPerGroup) {
      const int group = std::min(kHeadsPerGroup, heads - g0);
      Vec acc[kHeadsPerGroup][kKeysPerSum];
      for (int r = 0; r < kKeysPerSum; ++r) {
        Vec kv[NV];
        minivllm::load_floats(rows[r], kv, D);
        for (int g = 0; g < group; ++g) {
          acc[g][r] = qv[g0 + g][0] * kv[0];
          for (int j = 1; j < NV; ++j) acc[g][r] = at::vec::fmadd(qv[g0 + g][j], kv[j], acc[g][r]);
        }
      }
      for (int g = 0; g < group; ++g) sum_lanes(acc[g], scores + (g0 + g) * seq_len + t0, n);
    }
  }
  for (int g = 0; g < heads; ++g) softmax_inplace(scores + g * seq_len, seq_len);
  constexpr int NS = value_slice(G, NV);
  constexpr int kSliceElems = NS * Vec::size();
  for (int s = 0; s < D; s += kSliceElems) {
    Vec acc[G][NS];
    for (int g = 0; g < heads; ++g)
      for (int j = 0; j < NS; ++j) acc[g][j] = Vec(0.f);
    RowWalker<T, D> values(value_cache, block_ids, first, end, block_size);
    for (int64_t t = 0; t < seq_len; ++t) {
      Vec kv[NS];
      minivllm::load_floats(values.next() + s, kv, kSliceElems);
      for (int g = 0; g < heads; ++g) {
        const Vec p(scores[g * seq_len + t]);
        for (int j = 0; j < NS; ++j) acc[g][j] = at::vec::fmadd(p, kv[j], acc[g][j]);
      }
    }
    for (int g = 0; g < heads; ++g) minivllm::store_floats(acc[g], out + g * out_stride + s, kSliceElems);
  }
}

template <typename T, int D>
void paged_decode_attention_impl(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& kv_cache, const at::Tensor& token_indices,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 double scale, int64_t sliding_window) {
  const int64_t num_reqs = token_indices.size(0);
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(1);
  const int heads_per_kv = static_cast<int>(num_heads / num_kv_heads);
  const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t head_elems = num_blocks * block_size * D;  // one KV head's whole cache
  const T* key_cache = kv_cache.data_ptr<T>();
  const T* value_cache = key_cache + num_kv_heads * head_elems;
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tokens = token_indices.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t window = sliding_window > 0 ? sliding_window : std::numeric_limits<int64_t>::max();
  const int64_t max_len = std::min<int64_t>(*std::max_element(lens, lens + num_reqs), window);
  // Enough tokens per task that a thread's share outweighs waking it.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, max_len));
  auto attend = attend_kv_head<T, D, 0>;
  switch (heads_per_kv) {
    case 1: attend = attend_kv_head<T, D, 1>; break;
    case 2: attend = attend_kv_head<T, D, 2>; break;
    case 3: attend = attend_kv_head<T, D, 3>; break;
    case 4: attend = attend_kv_head<T, D, 4>; break;
    case 6: attend = attend_kv_head<T, D, 6>; break;  // e.g. Qwen2.5-1.5B
    case 7: attend = attend_kv_head<T, D, 7>; break;  // e.g. Qwen2.5-0.5B and 7B
    case 8: attend = attend_kv_head<T, D, 8>; break;
  }
  at::parallel_for(0, num_reqs * num_kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads_per_kv * max_len);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t row = tokens[r];
      attend(q + row * query.stride(0) + h * heads_per_kv * D, query.stride(1),
                           heads_per_kv, key_cache + h * head_elems, value_cache + h * head_elems,
                           tables + r * table_stride, std::max<int64_t>(0, lens[r] - window), lens[r], block_size,
                           static_cast<float>(scale), o + row * out.stride(0) + h * heads_per_kv * D,
                           out.stride(1), scores.data());
    }
  });
}

template <typename T>
void dispatch_head_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& token_indices, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  switch (query.size(2)) {
    case 64: return paged_decode_attention_impl<T, 64>(out, query, kv_cache, token_indices, block_tables, seq_lens, scale, sliding_window);
    case 128: return paged_decode_attention_impl<T, 128>(out, query, kv_cache, token_indices, block_tables, seq_lens, scale, sliding_window);
    case 256: return paged_decode_attention_impl<T, 256>(out, query, kv_cache, token_indices, block_tables, seq_lens, scale, sliding_window);
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim must be 64, 128 or 256, got ", query.size(2));
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& token_indices, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  if (token_indices.size(0) == 0) return;  // a step of prefills only
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "out must be shaped like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type());
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0 &&
              query.size(1) / kv_cache.size(1) <= kMaxHeadsPerKv, "unsupported head grouping");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "token_indices int64, block_tables int32 with contiguous rows, seq_lens int32");
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_head_dim<float>(out, query, kv_cache, token_indices, block_tables, seq_lens, scale, sliding_window);
    case at::kBFloat16: return dispatch_head_dim<c10::BFloat16>(out, query, kv_cache, token_indices, block_tables, seq_lens, scale, sliding_window);
    default: TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}

// Stores a step's new keys and values ([tokens, kv_heads, head_dim], rows may be strided views
// of the fused QKV output) at their slots: one copy per token and head, no transposed temporary.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type());
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_cache.size(1) &&
              key.size(2) == kv_cache.size(4) && key.stride(2) == 1 && value.stride(2) == 1);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0));
  const int64_t num_tokens = key.size(0), num_kv_heads = kv_cache.size(1);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t elem = kv_cache.element_size(), row_bytes = kv_cache.size(4) * elem;
  char* key_cache = static_cast<char*>(kv_cache.data_ptr());
  char* value_cache = key_cache + num_kv_heads * num_slots * row_bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  at::parallel_for(0, num_tokens, 512, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (h * num_slots + slots[t]) * row_bytes;
        std::memcpy(key_cache + dst, k + (t * key.stride(0) + h * key.stride(1)) * elem, row_bytes);
        std::memcpy(value_cache + dst, v + (t * value.stride(0) + h * value.stride(1)) * elem, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor token_indices, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window=0) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, &reshape_and_cache);
}
