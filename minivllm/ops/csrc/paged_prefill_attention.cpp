// Prefill attention on the CPU: every query token of a prompt, or of a later chunk of one, against
// its request's keys and values read from the cache blocks (after this step's K/V were written),
// under the causal mask. A query at position p sees the keys at positions 0..p, so a first chunk,
// a later chunk and a prompt after a prefix-cache hit are one case. With a sliding window W it
// sees keys p - W + 1 .. p only, and a tile reads no key before its first row's window (those
// blocks may be back in the pool). Built and loaded as
// torch.ops.minivllm_cpu.* by minivllm/ops/cpu_kernels.py.
//
// Cache layout per layer, as the decode kernel's: [2, num_kv_heads, num_blocks, block_size,
// head_dim]; index 0 holds keys, 1 values.
//
// Each work item is a tile: up to kMaxRowVecs vectors' worth of query rows (tokens x the query
// heads sharing one KV head) of one request. The tile's rows lie across the SIMD lanes: Q is
// transposed once per tile, and then Q.K^T, the causal mask, the softmax and P.V are all vertical
// vector operations over keys, each key and value element (in bfloat16 with AVX512-BF16: each
// pair of them) a broadcast; except that the bfloat16 P.V broadcasts each row's probability
// pairs against vectors of value pairs, so that its output comes out row by row. No horizontal
// reductions, no transposed K, and the scores of a whole tile (keys x rows) stay in float32.
// Tiles go to threads longest first from a shared counter: causal tiles differ in length.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_utils.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using minivllm::kMaxHeadsPerKv;
using minivllm::Vec;
using BF16 = c10::BFloat16;
constexpr int kLanes = Vec::size();
constexpr int kMaxRowVecs = 4;  // rows per tile: 64 on AVX-512
constexpr int kMaxRows = kMaxRowVecs * kLanes;
constexpr int kKeysPerStep = 4;  // keys per register block of Q.K^T
constexpr int kDimsPerStep = 4;  // head dims per register block of P.V (float32)

// bfloat16 with AVX512-BF16: Q.K^T and P.V as vdpbf16ps, which multiplies the two bfloat16
// halves of each 32-bit lane by those of the other operand exactly and adds both products to a
// float32 accumulator: half the multiply-adds of float32 FMAs, and K/V are read as stored. The
// probabilities are rounded to bfloat16 for P.V, as transformers' eager attention does in
// bfloat16; the scores, the softmax and the output stay float32.
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif
template <typename T>
constexpr bool kBf16Dot = kHasBf16Dot && std::is_same_v<T, BF16>;
using Pair = uint32_t;  // two bfloat16 values in one lane: the operand unit of vdpbf16ps

// Keys are scored kKeysPerStep at a time: buffers hold n keys rounded up, the extra ones zero.
inline int64_t padded_keys(int64_t n) { return (n + kKeysPerStep - 1) / kKeysPerStep * kKeysPerStep; }

struct Scratch {
  // float32 path
  std::vector<float> qt;  // [head_dim, kMaxRows]: the tile's scaled queries, rows in lanes
  std::vector<float> k, v;  // [keys, head_dim] float32 copies of the request's K/V
  std::vector<float> ot;  // [head_dim, kMaxRows]: the output, rows in lanes
  // bfloat16 path
  std::vector<Pair> qt2;  // [head_dim / 2, kMaxRows]: query element pairs, rows in lanes
  std::vector<BF16> kb;  // [keys, head_dim]: the request's keys, contiguous
  std::vector<Pair> v2;  // [keys / 2, head_dim]: values of keys 2i and 2i + 1 paired
  std::vector<Pair> p2;  // [keys / 2, kMaxRows]: probabilities of keys 2i and 2i + 1 paired
  // both
  std::vector<float> p;  // [keys, kMaxRows]: scores, then (float32 path) probabilities

  template <typename T, int D>
  void reserve(int64_t keys_pad) {
    if constexpr (kBf16Dot<T>) {
      qt2.resize(D / 2 * kMaxRows);
      kb.resize(keys_pad * D);
      v2.resize(keys_pad / 2 * D);
      p2.resize(keys_pad / 2 * kMaxRows);
    } else {
      qt.resize(D * kMaxRows);
      k.resize(keys_pad * D);
      v.resize(keys_pad * D);
      ot.resize(D * kMaxRows);
    }
    p.resize(keys_pad * kMaxRows);
  }
};

struct Tile {
  int64_t req, kv_head, first_token, num_tokens;
};

// The key or value at position first + t of one KV head's cache (t < n), or a row of zeros for
// the padding keys.
template <typename T, int D>
struct CacheRows {
  const T* cache;
  const int32_t* block_ids;
  int64_t block_size, first, n;
  const T* operator()(int64_t t) const {
    static const T zeros[D] = {};
    const int64_t pos = first + t;
    return t < n ? cache + (block_ids[pos / block_size] * block_size + pos % block_size) * D : zeros;
  }
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

// Keys or values of positions [0, n_pad) as float32 rows [n_pad, D], padding rows zero.
template <typename T, int D>
void gather_floats(const CacheRows<T, D>& rows, int64_t n_pad, float* dst) {
  for (int64_t t = 0; t < n_pad; ++t) copy_floats(rows(t), dst + t * D, D);
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
inline __m512i widen_low(__m256i halves) { return _mm512_cvtepu16_epi32(halves); }

// Lane i of the result: (a[i], b[i]) for 16 bfloat16 values of each.
inline __m512i pair_up(const BF16* a, const BF16* b) {
  const __m512i lo = widen_low(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i hi = widen_low(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// Lane i: (a[i], b[i]) rounded to bfloat16 (nearest even).
inline __m512i round_pair_up(const Vec& a, const Vec& b) {
  const __m512i lo = widen_low(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a)));
  const __m512i hi = widen_low(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(b)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// The 16 x 16 matrix of 32-bit elements with rows r[0..15], transposed: c[k] is column k.
inline void transpose_16x16(const __m512i (&r)[16], __m512i (&c)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + k], 128-bit lane l: rows 4g..4g+3 of column 4l + k.
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    // 128-bit lanes of v: rows 0-3 of columns k and 8 + k, then rows 4-7 of both (v1: rows
    // 8-15); w likewise for columns 4 + k and 12 + k.
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    c[k] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    c[8 + k] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    c[4 + k] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    c[12 + k] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// acc[c][v] = sum_i a_i[v] . b_i[c] for B columns and NRV row vectors held in registers: a_i is
// row vector v of pairs at a + i * RP, b_i[c] one pair at b + c * col_stride + i * step, broadcast.
template <int B, int NRV>
inline void dot_pairs_block(const Pair* a, const Pair* b, int64_t col_stride, int64_t step,
                            int64_t n, __m512 (&acc)[B][NRV]) {
  constexpr int RP = NRV * kLanes;
  for (int c = 0; c < B; ++c)
    for (int v = 0; v < NRV; ++v) acc[c][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512i av[NRV];
    for (int v = 0; v < NRV; ++v) av[v] = _mm512_loadu_si512(a + i * RP + v * kLanes);
    for (int c = 0; c < B; ++c) {
      const __m512i bv = _mm512_set1_epi32(static_cast<int>(b[c * col_stride + i * step]));
      for (int v = 0; v < NRV; ++v) acc[c][v] = dot_pairs(acc[c][v], av[v], bv);
    }
  }
}

// p[t][r] = scale * q_r . k_t for the tile's rows (in lanes), keys from contiguous rows kb.
template <int D, int NRV>
void scores_bf16(const BF16* q, int64_t q_tok_stride, int64_t q_head_stride, int heads,
                 int64_t rows, const BF16* kb, int64_t keys_pad, float scale, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  // qt2[j][r] = pair j of row r (rows past the tile's zero): 16 rows x 16 pairs at a time,
  // transposed in registers.
  Pair* qt2 = s.qt2.data();
  for (int64_t r0 = 0; r0 < RP; r0 += kLanes) {
    for (int j0 = 0; j0 < D / 2; j0 += kLanes) {
      __m512i in[kLanes], cols[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const int64_t r = r0 + i;
        in[i] = r < rows ? _mm512_loadu_si512(q + (r / heads) * q_tok_stride + (r % heads) * q_head_stride + 2 * j0)
                         : _mm512_setzero_si512();
      }
      transpose_16x16(in, cols);
      for (int k = 0; k < kLanes; ++k) _mm512_storeu_si512(qt2 + (j0 + k) * RP + r0, cols[k]);
    }
  }
  const Vec vscale(scale);
  const Pair* k2 = reinterpret_cast<const Pair*>(kb);
  for (int64_t t0 = 0; t0 < keys_pad; t0 += kKeysPerStep) {
    __m512 acc[kKeysPerStep][NRV];
    dot_pairs_block(qt2, k2 + t0 * (D / 2), D / 2, 1, D / 2, acc);
    for (int kb_ = 0; kb_ < kKeysPerStep; ++kb_)
      for (int v = 0; v < NRV; ++v) (Vec(acc[kb_][v]) * vscale).store(s.p.data() + (t0 + kb_) * RP + v * kLanes);
  }
}

// P.V from the paired probabilities and values, with the tile's rows as the broadcast operand:
// each row's output comes out as head_dim contiguous floats, scaled by its 1 / sum and written
// straight to `out` (rows in lanes would need a transposition back, a scalar load per element:
// ~12% of this kernel's time). Sums in the same order either way, so the same results.
template <typename T, int D, int NRV>
void values_bf16(int64_t keys_pad, const float* inv, int64_t rows, int heads, T* out,
                 int64_t out_tok_stride, int64_t out_head_stride, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  constexpr int DV = D / kLanes;
  constexpr int kRowsPerStep = 16 / DV;  // 16 accumulators, as the other register blocks
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerStep) {
    __m512 acc[kRowsPerStep][DV];
    dot_pairs_block(s.v2.data(), s.p2.data() + r0, 1, RP, keys_pad / 2, acc);
    for (int c = 0; c < kRowsPerStep && r0 + c < rows; ++c) {
      const int64_t r = r0 + c;
      Vec o[DV];
      for (int v = 0; v < DV; ++v) o[v] = Vec(acc[c][v]) * Vec(inv[r]);
      minivllm::store_floats(o, out + (r / heads) * out_tok_stride + (r % heads) * out_head_stride, D);
    }
  }
}
#endif

// p[t][r] = q_r . k_t (q scaled first), kKeysPerStep keys x NRV row vectors per register block.
template <typename T, int D, int NRV>
void scores_f32(const T* q, int64_t q_tok_stride, int64_t q_head_stride, int heads, int64_t rows,
                const float* kf, int64_t keys_pad, float scale, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  float* qt = s.qt.data();
  std::fill(qt, qt + D * RP, 0.f);
  float row[D];
  for (int64_t r = 0; r < rows; ++r) {
    copy_floats(q + (r / heads) * q_tok_stride + (r % heads) * q_head_stride, row, D);
    for (int d = 0; d < D; ++d) qt[d * RP + r] = row[d] * scale;
  }
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
      for (int v = 0; v < NRV; ++v) acc[kb][v].store(s.p.data() + (t0 + kb) * RP + v * kLanes);
  }
}

// ot[d][r] = sum_t p[t][r] * v_t[d], kDimsPerStep dims x NRV row vectors per register block.
template <int D, int NRV>
void values_f32(const float* vf, int64_t keys_pad, const Vec* inv, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  const float* p = s.p.data();
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
      for (int v = 0; v < NRV; ++v) (acc[db][v] * inv[v]).store(s.ot.data() + (d0 + db) * RP + v * kLanes);
  }
}

// One tile: rows (tokens x the query heads of one KV head) of one request against its keys
// from the cache (positions keys.first .. keys.first + keys.n - 1), written to out. `window`:
// the sliding window, or a number beyond every position.
template <typename T, int D, int NRV>
void attend_tile(const T* q, int64_t q_tok_stride, int64_t q_head_stride, int heads,
                 int64_t num_tokens, int64_t first_pos, int64_t window, const CacheRows<T, D>& keys,
                 const CacheRows<T, D>& values, float scale, T* out, int64_t out_tok_stride,
                 int64_t out_head_stride, Scratch& s) {
  constexpr int RP = NRV * kLanes;
  const int64_t rows = num_tokens * heads;
  const int64_t num_keys = keys.n;
  const int64_t keys_pad = padded_keys(num_keys);
  float* p = s.p.data();

  // Scores. Row r is token r / heads, query head r % heads; lanes past the tile's rows are zero.
  if constexpr (kBf16Dot<T>) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
    for (int64_t t = 0; t < keys_pad; ++t) std::memcpy(s.kb.data() + t * D, keys(t), D * sizeof(T));
    scores_bf16<D, NRV>(q, q_tok_stride, q_head_stride, heads, rows, s.kb.data(), keys_pad, scale, s);
#endif
  } else {
    gather_floats(keys, keys_pad, s.k.data());
    scores_f32<T, D, NRV>(q, q_tok_stride, q_head_stride, heads, rows, s.k.data(), keys_pad, scale, s);
  }

  // Causal mask: row r (position first_pos + r / heads) sees keys up to its own position; the
  // keys before the tile's first position are visible to every row, padding keys to none. A
  // window also hides the keys at or before the row's position - window.
  const int64_t first = keys.first;
  Vec last_visible[NRV], last_hidden[NRV];
  for (int v = 0; v < NRV; ++v) {
    float lim[kLanes], hid[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t pos = first_pos + std::min<int64_t>(v * kLanes + l, rows - 1) / heads;
      lim[l] = static_cast<float>(pos);
      hid[l] = static_cast<float>(std::max<int64_t>(pos - window, -1));
    }
    last_visible[v] = Vec::loadu(lim);
    last_hidden[v] = Vec::loadu(hid);
  }
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  for (int64_t t = std::max<int64_t>(0, first_pos - first); t < keys_pad; ++t) {
    const Vec pos(static_cast<float>(first + t));
    for (int v = 0; v < NRV; ++v) {
      float* pt = p + t * RP + v * kLanes;
      Vec::blendv(Vec::loadu(pt), neg_inf, pos > last_visible[v]).store(pt);
    }
  }
  // The last row's window starts latest: keys before it may be hidden from some rows.
  const int64_t hidden_end = std::min<int64_t>(keys_pad, first_pos + num_tokens - window - first);
  for (int64_t t = 0; t < hidden_end; ++t) {
    const Vec pos(static_cast<float>(first + t));
    for (int v = 0; v < NRV; ++v) {
      float* pt = p + t * RP + v * kLanes;
      Vec::blendv(Vec::loadu(pt), neg_inf, pos <= last_hidden[v]).store(pt);
    }
  }

  // Softmax over keys, per lane; each row sees its own position's key, so each maximum is finite.
  Vec mx[NRV], sum[NRV];
  for (int v = 0; v < NRV; ++v) {
    mx[v] = neg_inf;
    sum[v] = Vec(0.f);
  }
  for (int64_t t = 0; t < num_keys; ++t)
    for (int v = 0; v < NRV; ++v) mx[v] = at::vec::maximum(mx[v], Vec::loadu(p + t * RP + v * kLanes));
  for (int64_t t = 0; t < keys_pad; t += 2)
    for (int v = 0; v < NRV; ++v) {
      float* pt = p + t * RP + v * kLanes;
      const Vec e0 = (Vec::loadu(pt) - mx[v]).exp_u20();
      const Vec e1 = (Vec::loadu(pt + RP) - mx[v]).exp_u20();
      sum[v] = sum[v] + e0 + e1;
      if constexpr (kBf16Dot<T>) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
        _mm512_storeu_si512(s.p2.data() + t / 2 * RP + v * kLanes, round_pair_up(e0, e1));
#endif
      } else {
        e0.store(pt);
        e1.store(pt + RP);
      }
    }
  Vec inv[NRV];
  for (int v = 0; v < NRV; ++v) inv[v] = Vec(1.f) / sum[v];

  // Output.
  if constexpr (kBf16Dot<T>) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
    for (int64_t t = 0; t < keys_pad; t += 2)
      for (int d = 0; d < D; d += kLanes)
        _mm512_storeu_si512(s.v2.data() + t / 2 * D + d, pair_up(values(t) + d, values(t + 1) + d));
    float inv_rows[RP];
    for (int v = 0; v < NRV; ++v) inv[v].store(inv_rows + v * kLanes);
    values_bf16<T, D, NRV>(keys_pad, inv_rows, rows, heads, out, out_tok_stride, out_head_stride, s);
#endif
  } else {
    gather_floats(values, keys_pad, s.v.data());
    values_f32<D, NRV>(s.v.data(), keys_pad, inv, s);
    float row[D];
    for (int64_t r = 0; r < rows; ++r) {
      Vec o[D / kLanes];
      for (int d = 0; d < D; ++d) row[d] = s.ot[d * RP + r];
      for (int j = 0; j < D / kLanes; ++j) o[j] = Vec::loadu(row + j * kLanes);
      minivllm::store_floats(o, out + (r / heads) * out_tok_stride + (r % heads) * out_head_stride, D);
    }
  }
}

template <typename T, int D>
void paged_prefill_attention_impl(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& kv_cache, const at::Tensor& token_starts,
                                  const at::Tensor& query_lens, const at::Tensor& seq_lens,
                                  const at::Tensor& block_tables, double scale,
                                  int64_t sliding_window) {
  const int64_t num_reqs = token_starts.size(0);
  const int64_t num_kv_heads = kv_cache.size(1);
  // Far beyond any position: no window.
  const int64_t window = sliding_window > 0 ? sliding_window : std::numeric_limits<int32_t>::max();
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
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < qlens[r]; i += tile_tokens)
        tiles.push_back({r, h, i, std::min<int64_t>(tile_tokens, qlens[r] - i)});
  // A tile reads the keys from its first row's window start to its last row's position.
  auto first_key = [&](const Tile& t) {
    return std::max<int64_t>(0, lens[t.req] - qlens[t.req] + t.first_token - window + 1);
  };
  auto keys_seen = [&](const Tile& t) {
    return lens[t.req] - qlens[t.req] + t.first_token + t.num_tokens - first_key(t);
  };
  for (const Tile& t : tiles) max_keys = std::max<int64_t>(max_keys, keys_seen(t));
  // Longest first, so the last tiles handed out are short.
  std::sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) { return keys_seen(a) > keys_seen(b); });
  const int64_t keys_pad = padded_keys(max_keys);

  std::atomic<int64_t> next{0};
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1, [&](int64_t, int64_t) {
    Scratch s;
    s.reserve<T, D>(keys_pad);
    for (int64_t i = next++; i < num_tiles; i = next++) {
      const Tile& tile = tiles[i];
      const int64_t num_keys = keys_seen(tile);
      const int64_t first_pos = lens[tile.req] - qlens[tile.req] + tile.first_token;
      const int32_t* block_ids = tables + tile.req * block_tables.stride(0);
      const int64_t first = first_key(tile);
      const CacheRows<T, D> keys{key_cache + tile.kv_head * head_elems, block_ids, block_size, first, num_keys};
      const CacheRows<T, D> values{value_cache + tile.kv_head * head_elems, block_ids, block_size, first, num_keys};
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
      attend(q, query.stride(0), query.stride(1), heads, tile.num_tokens, first_pos, window, keys, values,
             static_cast<float>(scale), o, out.stride(0), out.stride(1), s);
    }
  });
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& token_starts, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale, int64_t sliding_window) {
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
      case 64: return paged_prefill_attention_impl<T, 64>(out, query, kv_cache, token_starts, query_lens, seq_lens, block_tables, scale, sliding_window);
      case 128: return paged_prefill_attention_impl<T, 128>(out, query, kv_cache, token_starts, query_lens, seq_lens, block_tables, scale, sliding_window);
      case 256: return paged_prefill_attention_impl<T, 256>(out, query, kv_cache, token_starts, query_lens, seq_lens, block_tables, scale, sliding_window);
      default: TORCH_CHECK(false, "paged_prefill_attention: head_dim must be 64, 128 or 256, got ", query.size(2));
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
        "Tensor query_lens, Tensor seq_lens, Tensor block_tables, float scale, int sliding_window=0) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
