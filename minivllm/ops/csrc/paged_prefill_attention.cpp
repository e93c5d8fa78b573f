// Prefill attention on the CPU: every query token of a prompt, or of a later chunk of one, against
// its request's keys and values read from the cache blocks (after this step's K/V were written),
// under the causal mask. A query at position p sees the keys at positions 0..p, so a first chunk,
// a later chunk and a prompt after a prefix-cache hit are one case. Built and loaded as
// torch.ops.minivllm_cpu.* by minivllm/ops/cpu_kernels.py.
//
// Cache layout per layer, as the decode kernel's: [2, num_kv_heads, num_blocks, block_size,
// head_dim]; index 0 holds keys, 1 values.
//
// Each work item is a tile: up to kMaxRowVecs vectors' worth of query rows (tokens x the query
// heads sharing one KV head) of one request. The tile's rows lie across the SIMD lanes: Q is
// transposed once per tile, and then Q.K^T, the causal mask, the softmax and P.V are all vertical
// vector operations over keys, each key and value element a broadcast. No horizontal
// reductions, no transposed K, and the scores of a whole tile (keys x rows) stay in float32.
// Tiles go to threads longest first from a shared counter: causal tiles differ in length.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "vec_utils.h"

namespace {

using minivllm::kMaxHeadsPerKv;
using minivllm::Vec;
constexpr int kLanes = Vec::size();
constexpr int kMaxRowVecs = 4;  // rows per tile: 64 on AVX-512
constexpr int kMaxRows = kMaxRowVecs * kLanes;
constexpr int kKeysPerStep = 4;  // keys per register block of Q.K^T
constexpr int kDimsPerStep = 4;  // head dims per register block of P.V

// Keys are scored kKeysPerStep at a time: buffers hold n keys rounded up, the extra ones zero.
inline int64_t padded_keys(int64_t n) { return (n + kKeysPerStep - 1) / kKeysPerStep * kKeysPerStep; }

struct Scratch {
  std::vector<float> qt;  // [head_dim, kMaxRows]: the tile's scaled queries, rows in lanes
  std::vector<float> k, v;  // [keys, head_dim] float32 copies of the request's K/V
  std::vector<float> p;  // [keys, kMaxRows]: scores, then probabilities
  std::vector<float> ot;  // [head_dim, kMaxRows]: the output, rows in lanes
};

struct Tile {
  int64_t req, kv_head, first_token, num_tokens;
};

// n values (a multiple of minivllm::kPair) of T as float32.
template <typename T>
inline void copy_floats(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += minivllm::kPair) {
    Vec lo, hi;
    minivllm::load_pair(src + i, lo, hi);
    lo.store(dst + i);
    hi.store(dst + i + kLanes);
  }
}

// Keys or values of positions [0, n) of one KV head, from the blocks in block_ids, as float32
// rows [n, D]; rows up to n_pad are zero.
template <typename T, int D>
void gather_floats(const T* cache, const int32_t* block_ids, int64_t block_size, int64_t n,
                   int64_t n_pad, float* dst) {
  for (int64_t t = 0; t < n; t += block_size) {
    const int64_t count = std::min(block_size, n - t);
    copy_floats(cache + block_ids[t / block_size] * block_size * D, dst + t * D, count * D);
  }
  std::fill(dst + n * D, dst + n_pad * D, 0.f);
}

template <typename T, int D, int NRV>
void attend_tile(const T* q, int64_t q_tok_stride, int64_t q_head_stride, int heads,
                 int64_t num_tokens, int64_t first_pos, const float* kf, const float* vf,
                 int64_t num_keys, float scale, T* out, int64_t out_tok_stride,
                 int64_t out_head_stride, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  const int64_t rows = num_tokens * heads;
  const int64_t keys_pad = padded_keys(num_keys);
  float* qt = s.qt.data();
  float* p = s.p.data();
  float* ot = s.ot.data();

  // Row r is token r / heads, query head r % heads; lanes past the tile's rows hold zeros.
  std::fill(qt, qt + D * RP, 0.f);
  float row[D];
  for (int64_t r = 0; r < rows; ++r) {
    copy_floats(q + (r / heads) * q_tok_stride + (r % heads) * q_head_stride, row, D);
    for (int d = 0; d < D; ++d) qt[d * RP + r] = row[d] * scale;
  }

  // Scores: p[t][r] = q_r . k_t, kKeysPerStep keys x NRV row vectors per register block.
  for (int64_t t0 = 0; t0 < keys_pad; t0 += kKeysPerStep) {
    Vec acc[kKeysPerStep][NRV];
    for (int kb = 0; kb < kKeysPerStep; ++kb)
      for (int v = 0; v < NRV; ++v) acc[kb][v] = Vec(0.f);
    const float* k = kf + t0 * D;
    for (int d = 0; d < D; ++d) {
      Vec qv[NRV];
      for (int v = 0; v < NRV; ++v) qv[v] = Vec::loadu(qt + d * RP + v * kLanes);
      for (int kb = 0; kb < kKeysPerStep; ++kb) {
        const Vec kv(k[kb * D + d]);
        for (int v = 0; v < NRV; ++v) acc[kb][v] = at::vec::fmadd(qv[v], kv, acc[kb][v]);
      }
    }
    for (int kb = 0; kb < kKeysPerStep; ++kb)
      for (int v = 0; v < NRV; ++v) acc[kb][v].store(p + (t0 + kb) * RP + v * kLanes);
  }

  // Causal mask: row r (position first_pos + r / heads) sees keys up to its own position; the
  // keys before the tile's first position are visible to every row, padding keys to none.
  Vec last_visible[NRV];
  for (int v = 0; v < NRV; ++v) {
    float lim[kLanes];
    for (int l = 0; l < kLanes; ++l)
      lim[l] = static_cast<float>(first_pos + std::min<int64_t>(v * kLanes + l, rows - 1) / heads);
    last_visible[v] = Vec::loadu(lim);
  }
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  for (int64_t t = first_pos; t < keys_pad; ++t) {
    const Vec pos(static_cast<float>(t));
    for (int v = 0; v < NRV; ++v) {
      float* pt = p + t * RP + v * kLanes;
      Vec::blendv(Vec::loadu(pt), neg_inf, pos > last_visible[v]).store(pt);
    }
  }

  // Softmax over keys, per lane; key 0 is visible to every row, so each maximum is finite.
  Vec mx[NRV], sum[NRV];
  for (int v = 0; v < NRV; ++v) {
    mx[v] = neg_inf;
    sum[v] = Vec(0.f);
  }
  for (int64_t t = 0; t < num_keys; ++t)
    for (int v = 0; v < NRV; ++v) mx[v] = at::vec::maximum(mx[v], Vec::loadu(p + t * RP + v * kLanes));
  for (int64_t t = 0; t < keys_pad; ++t)
    for (int v = 0; v < NRV; ++v) {
      float* pt = p + t * RP + v * kLanes;
      const Vec e = (Vec::loadu(pt) - mx[v]).exp_u20();
      e.store(pt);
      sum[v] = sum[v] + e;
    }
  Vec inv[NRV];
  for (int v = 0; v < NRV; ++v) inv[v] = Vec(1.f) / sum[v];

  // Output: ot[d][r] = sum_t p[t][r] * v_t[d], kDimsPerStep dims x NRV row vectors per block.
  for (int d0 = 0; d0 < D; d0 += kDimsPerStep) {
    Vec acc[kDimsPerStep][NRV];
    for (int db = 0; db < kDimsPerStep; ++db)
      for (int v = 0; v < NRV; ++v) acc[db][v] = Vec(0.f);
    for (int64_t t = 0; t < keys_pad; ++t) {
      Vec pv[NRV];
      for (int v = 0; v < NRV; ++v) pv[v] = Vec::loadu(p + t * RP + v * kLanes);
      for (int db = 0; db < kDimsPerStep; ++db) {
        const Vec vv(vf[t * D + d0 + db]);
        for (int v = 0; v < NRV; ++v) acc[db][v] = at::vec::fmadd(pv[v], vv, acc[db][v]);
      }
    }
    for (int db = 0; db < kDimsPerStep; ++db)
      for (int v = 0; v < NRV; ++v) (acc[db][v] * inv[v]).store(ot + (d0 + db) * RP + v * kLanes);
  }

  for (int64_t r = 0; r < rows; ++r) {
    Vec o[D / kLanes];
    for (int d = 0; d < D; ++d) row[d] = ot[d * RP + r];
    for (int j = 0; j < D / kLanes; ++j) o[j] = Vec::loadu(row + j * kLanes);
    minivllm::store_floats(o, out + (r / heads) * out_tok_stride + (r % heads) * out_head_stride, D);
  }
}

template <typename T, int D>
void paged_prefill_attention_impl(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& kv_cache, const at::Tensor& token_starts,
                                  const at::Tensor& query_lens, const at::Tensor& seq_lens,
                                  const at::Tensor& block_tables, double scale) {
  const int64_t num_reqs = token_starts.size(0);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int heads = static_cast<int>(query.size(1) / num_kv_heads);
  const int64_t block_size = kv_cache.size(3);
  const int64_t head_elems = kv_cache.size(2) * block_size * D;  // one KV head's whole cache
  const T* key_cache = kv_cache.data_ptr<T>();
  const T* value_cache = key_cache + num_kv_heads * head_elems;
  const int64_t* starts = token_starts.data_ptr<int64_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  const int64_t tile_tokens = std::max(1, kMaxRows / heads);
  std::vector<Tile> tiles;
  int64_t max_keys = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    max_keys = std::max<int64_t>(max_keys, lens[r]);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < qlens[r]; i += tile_tokens)
        tiles.push_back({r, h, i, std::min<int64_t>(tile_tokens, qlens[r] - i)});
  }
  // Longest first (keys seen by the tile's last row), so the last tiles handed out are short.
  auto keys_seen = [&](const Tile& t) { return lens[t.req] - qlens[t.req] + t.first_token + t.num_tokens; };
  std::sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) { return keys_seen(a) > keys_seen(b); });
  const int64_t keys_pad = padded_keys(max_keys);

  std::atomic<int64_t> next{0};
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1, [&](int64_t, int64_t) {
    Scratch s;
    s.qt.resize(D * kMaxRows);
    s.ot.resize(D * kMaxRows);
    s.k.resize(keys_pad * D);
    s.v.resize(keys_pad * D);
    s.p.resize(keys_pad * kMaxRows);
    for (int64_t i = next++; i < num_tiles; i = next++) {
      const Tile& tile = tiles[i];
      const int64_t num_keys = keys_seen(tile);
      const int64_t first_pos = lens[tile.req] - qlens[tile.req] + tile.first_token;
      const int32_t* block_ids = tables + tile.req * block_tables.stride(0);
      const int64_t pad = padded_keys(num_keys);
      gather_floats<T, D>(key_cache + tile.kv_head * head_elems, block_ids, block_size, num_keys, pad, s.k.data());
      gather_floats<T, D>(value_cache + tile.kv_head * head_elems, block_ids, block_size, num_keys, pad, s.v.data());
      const int64_t token = starts[tile.req] + tile.first_token;
      const T* q = query.data_ptr<T>() + token * query.stride(0) + tile.kv_head * heads * query.stride(1);
      T* o = out.data_ptr<T>() + token * out.stride(0) + tile.kv_head * heads * out.stride(1);
      const int64_t row_vecs = (tile.num_tokens * heads + kLanes - 1) / kLanes;
      auto attend = attend_tile<T, D, kMaxRowVecs>;
      switch (row_vecs) {
        case 1: attend = attend_tile<T, D, 1>; break;
        case 2: attend = attend_tile<T, D, 2>; break;
        case 3: attend = attend_tile<T, D, 3>; break;
      }
      attend(q, query.stride(0), query.stride(1), heads, tile.num_tokens, first_pos, s.k.data(),
             s.v.data(), num_keys, static_cast<float>(scale), o, out.stride(0), out.stride(1), s);
    }
  });
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& token_starts, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale) {
  const int64_t num_reqs = token_starts.size(0);
  if (num_reqs == 0) return;  // a step of decodes only
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "out must be shaped like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type());
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache and query head sizes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0 &&
              query.size(1) / kv_cache.size(1) <= kMaxHeadsPerKv, "unsupported head grouping");
  TORCH_CHECK(token_starts.scalar_type() == at::kLong && query_lens.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
              block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
              query_lens.size(0) == num_reqs && seq_lens.size(0) == num_reqs &&
              block_tables.size(0) == num_reqs && token_starts.is_contiguous() &&
              query_lens.is_contiguous() && seq_lens.is_contiguous(),
              "token_starts int64, query_lens/seq_lens int32, block_tables int32 [reqs, blocks]");
  // A bad row here would read or write outside the tensors: every index is checked once.
  const int64_t* starts = token_starts.data_ptr<int64_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t block_size = kv_cache.size(3), num_blocks = kv_cache.size(2);
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(qlens[r] >= 1 && lens[r] >= qlens[r] && starts[r] >= 0 &&
                starts[r] + qlens[r] <= query.size(0), "prefill request ", r, " has bad lengths");
    const int64_t used = (lens[r] + block_size - 1) / block_size;
    TORCH_CHECK(used <= block_tables.size(1), "prefill request ", r, " has too few blocks");
    const int32_t* ids = block_tables.data_ptr<int32_t>() + r * block_tables.stride(0);
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(ids[b] >= 0 && ids[b] < num_blocks, "block ", ids[b], " outside the cache");
  }
  const auto dispatch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    switch (query.size(2)) {
      case 64: return paged_prefill_attention_impl<T, 64>(out, query, kv_cache, token_starts, query_lens, seq_lens, block_tables, scale);
      case 128: return paged_prefill_attention_impl<T, 128>(out, query, kv_cache, token_starts, query_lens, seq_lens, block_tables, scale);
      default: TORCH_CHECK(false, "paged_prefill_attention: head_dim must be 64 or 128, got ", query.size(2));
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch(static_cast<float*>(nullptr));
    case at::kBFloat16: return dispatch(static_cast<c10::BFloat16*>(nullptr));
    default: TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor token_starts, "
        "Tensor query_lens, Tensor seq_lens, Tensor block_tables, float scale) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
