// Paged attention on CPU, called from JAX through the XLA FFI (target "tokenmill_paged_attention").
//
// Semantics are those of tokenmill.ops.attention.paged_attention_ref: token t of a ragged batch
// attends to the keys of its request (row token_request[t] of block_tables) at context positions
// p with p <= positions[t] and, with a window W, p > positions[t] - W. K/V rows are read in place
// from the full cache [layers, num_blocks, block_size, kv_heads, head_dim] through the block
// table: nothing is gathered. Softmax over chunks of 64 keys of the context, fp32 accumulation: each
// chunk's max, sum and P . V on their own, folded into the running ones in order (fold_chunk); per-head
// sink logits (gpt-oss) join each denominator at the end.
// Query heads are grouped per KV head (GQA): one work item is a token and one or all of its kv
// heads, or a tile of a prefill's consecutive tokens (attend_tile: each K and V row read once for all
// of them, each token's result bit for bit what it gets alone), or, where there are few tokens, one kv
// head and one chunk of a token's keys (the split path: the chunks' results are folded after), and the
// items are spread over XLA's intra-op thread pool (parallel.h).
//
// Index semantics follow jnp indexing (what the reference does): a negative layer / request /
// block id wraps once, then it is clamped into range, so no input can read out of bounds. A token
// with no visible key (negative position, or a window that excludes everything) gets, like the
// reference's all-masked softmax, the plain mean of V over its whole block-table row.
//
// Built by tokenmill/ops/cpu/build.py with -O3 and either -mavx2 -mfma [-mavx512f] (checked at run time) or
// no ISA flags (portable); the inner loops use GCC vector extensions, which lower to either.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vector_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#define TM_INLINE static inline __attribute__((always_inline))

constexpr int kChunk = 64;  // keys per softmax chunk, folded in order (a multiple of 16, the widest vector)
constexpr int kMaxGroup = 4;  // query heads that meet each V row together (P . V)

TM_INLINE v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

TM_INLINE v8f load8(const uint16_t* p) {  // bfloat16 → float32
#if defined(__AVX2__)
  // one vpmovzxwd from memory: GCC widens the vector extension's form half by half (six instructions,
  // and on AVX-512 a spill)
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return (v8f)w;
#else
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  v8u w = __builtin_convertvector(h, v8u) << 16;
  return (v8f)w;
#endif
}

TM_INLINE void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }

// The vectors the scores and P . V run on: W floats (8, or 16 where the build has AVX-512 and the
// head size is a multiple of 16: half the multiply-adds and loads of 8-wide ones). `fold` adds the
// halves of a 16-wide vector into 8 lanes, so that every width ends in the same 8-lane reduction.
// `splat` broadcasts a float (V{} + x would add 0 first: a scalar add the compiler may not drop, as it
// turns x = -0 into +0).
template <int W>
struct Vec;

template <>
struct Vec<8> {
  using type = v8f;
  using itype = v8i;
  TM_INLINE v8f load(const float* p) { return load8(p); }
  TM_INLINE v8f load(const uint16_t* p) { return load8(p); }
  TM_INLINE v8f fold(v8f x) { return x; }
  TM_INLINE v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
};

#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

template <>
struct Vec<16> {
  using type = v16f;
  using itype = v16i;
  TM_INLINE v16f load(const float* p) {
    v16f x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  TM_INLINE v16f load(const uint16_t* p) {  // bfloat16 → float32, one vpmovzxwd (as load8)
    const __m512i w =
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    return (v16f)w;
  }
  TM_INLINE v8f fold(v16f x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  TM_INLINE v16f splat(float x) { return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
};
constexpr int kWide = 16;
#else
constexpr int kWide = 8;
#endif

TM_INLINE float to_f32(float x) { return x; }

TM_INLINE float to_f32(uint16_t x) {
  uint32_t w = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

TM_INLINE void store_f32(float x, float* p) { *p = x; }

TM_INLINE void store_f32(float x, uint16_t* p) {  // float32 → bfloat16, round to nearest even
  uint32_t w;
  std::memcpy(&w, &x, sizeof(w));
  if ((w & 0x7fffffffu) > 0x7f800000u) {
    *p = uint16_t((w >> 16) | 0x40);  // quiet NaN
    return;
  }
  w += 0x7fffu + ((w >> 16) & 1u);
  *p = uint16_t(w >> 16);
}

TM_INLINE float hsum(v8f x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// exp for x <= 0 (vector_exp.h), on W-wide vectors; x below the float range, and -inf, give 0.
template <int W>
TM_INLINE typename Vec<W>::type expv(typename Vec<W>::type x) {
  using V = typename Vec<W>::type;
  using I = typename Vec<W>::itype;
  const V lo = V{} - 87.33654f;
  I under = x < lo;
  const V y = exp_in_range<V, I>(under ? lo : x);
  return under ? V{} : y;
}

// Eight vectors of partial sums → the vector of their eight totals, each summed in the same order
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), whatever its place: 7 adds and 14 shuffles
// instead of eight horizontal sums.
TM_INLINE v8f reduce8(const v8f* a) {
  auto pairs = [](v8f x, v8f y) {  // [x01, y01, x23, y23, x45, y45, x67, y67]
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  auto quads = [](v8f x, v8f y) {  // from two pairs(): [a0123, b0123, c0123, d0123, a4567, ...]
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const v8f low = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));
  const v8f high = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Keys a pass of scores8 takes for GN heads: GN x keys accumulators, the GN q vectors and a K vector
// in the registers (AVX-512's 32: eight keys for up to three heads; AVX2's 16: eight keys for one head,
// four for two or three).
#if defined(__AVX512F__)
template <int GN>
constexpr int kScoreKeys = 8;
#else
template <int GN>
constexpr int kScoreKeys = GN == 1 ? 8 : 4;
#endif

// s[g * kChunk + j] = q[g] · k_j for GN heads and the eight keys k_j = k[j] + off, on W-wide vectors,
// kScoreKeys<GN> keys a pass: each K vector is loaded (and, from bfloat16, widened) once for all GN
// heads. A score's sum does not depend on GN or the pass: its vector chain over d in order, then reduce8.
template <int GN, int W, typename KT>
TM_INLINE void scores8(const float* q, const KT* const* k, int64_t off, int64_t D, float* s) {
  using V = typename Vec<W>::type;
  constexpr int KP = kScoreKeys<GN>;
  v8f folded[GN][8];
  int64_t d = 0;
  for (int j0 = 0; j0 < 8; j0 += KP) {
    V a[GN][KP];
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < KP; ++j) a[g][j] = V{};
    for (d = 0; d + W <= D; d += W) {
      V qv[GN];
      for (int g = 0; g < GN; ++g) qv[g] = Vec<W>::load(q + g * D + d);
      for (int j = 0; j < KP; ++j) {
        const V x = Vec<W>::load(k[j0 + j] + off + d);
        for (int g = 0; g < GN; ++g) a[g][j] += qv[g] * x;
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < KP; ++j) folded[g][j0 + j] = Vec<W>::fold(a[g][j]);
  }
  for (int g = 0; g < GN; ++g) {
    v8f r = reduce8(folded[g]);
    for (int64_t e = d; e < D; ++e)  // head sizes that are not a multiple of 8
      for (int j = 0; j < 8; ++j) r[j] += q[g * D + e] * to_f32(k[j][off + e]);
    store8(s + g * kChunk, r);
  }
}

// Query heads (of one kv head) scored together, in one pass over the keys.
constexpr int kScoreGroup = 3;

// Software prefetch of the K slots `kPrefetchAhead` keys ahead of the one being scored, into L2
// (prefetcht1): the keys of one request are scattered over blocks, which the hardware prefetcher
// cannot guess. On AMD Zen 4, 30 layers of SmolLM2 decoding (keys from memory): batch 64 x 192 keys
// 39.1 -> 34.3 ms, 16 x 1100 keys 61.1 -> 46.6, 1 x 300 keys 1.20 -> 0.43 ms, against 6 keys ahead
// into L1 (32 ahead into L2: 33.3 ms; 64: 34.6; 32 into L3 only: 35.6).
constexpr int kPrefetchAhead = 16;
// V rows are prefetched by P . V itself, the same distance ahead, into L1: when the scores' pass
// fetched them with the keys, that pass asked for twice the bytes while they waited a whole chunk
// in L2 (Zen 4, 3 runs each: 64 x 192 keys 34.3-35.8 -> 32.6-34.7 ms; 16 x 1100, 49.9-50.9 -> 44.4-47.5).
constexpr int kValuePrefetchAhead = 16;

template <typename KT>
struct Prefetch {
  const KT* const* kp = nullptr;  // slot pointers from the current key on (nullptr: no prefetch)
  int64_t count = 0;  // valid pointers from the current key on
  int64_t off = 0;  // elements from the slot start to the item's first kv head
  int64_t bytes = 0;  // bytes of the item's kv heads in one slot
};

template <typename KT>
TM_INLINE void prefetch_key(const Prefetch<KT>& pf, int64_t j) {
  if (pf.kp == nullptr || j >= pf.count) return;
  const char* k = reinterpret_cast<const char*>(pf.kp[j] + pf.off);
  for (int64_t b = 0; b < pf.bytes; b += 64) __builtin_prefetch(k + b, 0, 2);
  __builtin_prefetch(k + pf.bytes - 1, 0, 2);  // rows need not start on a cache line
}

// The K and V rows of the item this thread runs next (its first kNextItemBytes of them), fetched into
// L2 while this one runs, a few cache lines at every step of its loops (a group of 8 keys scored, a key
// of P . V). The 16 keys ahead that an item prefetches of its own hide the latency of one block; this
// hides that of the next item's first blocks, and keeps reads in flight all the time: a core has few
// misses in flight, so a burst of prefetches (a chunk's share of the next item at once, before) stalls
// it at the prefetches while the arithmetic between bursts leaves the memory idle. Zen 4, 30 layers of
// SmolLM2 decoding at batch 64 x 192 keys (566 MB of K and V; reading them alone takes ~22 ms),
// alternating runs of 25: medians 27.9-33.2 -> 24.9-27.5 ms (one 32.7); 16 x 1100 keys, 52.1-58.2 ->
// 50.3-52.6 ms. An item's keys that the item before it fetched are not prefetched again.
constexpr int64_t kNextItemBytes = 384 << 10;

template <typename KT>
struct NextItem {
  const KT* const* kp = nullptr;  // the next item's slot pointers (nullptr: nothing to fetch)
  const KT* const* vp = nullptr;
  int64_t count = 0;  // its keys to fetch
  int64_t off = 0;  // elements from the slot start to the next item's first kv head
  int64_t bytes = 0;  // bytes of the next item's kv heads in one slot
  int64_t per_step = 0;  // cache lines per step of P . V (a group of scores: 8 steps)
  // where the stream stands: key j's K row (or its V row), from `line` to `last`
  int64_t j = 0;
  bool value = false;
  const char* line = nullptr;
  const char* last = nullptr;

  inline __attribute__((always_inline)) void start_row() {
    const char* row = reinterpret_cast<const char*>((value ? vp : kp)[j] + off);
    line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63));
    last = row + bytes - 1;
  }

  inline __attribute__((always_inline)) void step(int64_t steps = 1) {
    for (int64_t i = 0; i < steps * per_step && j < count; ++i) {
      if (line == nullptr) start_row();
      __builtin_prefetch(line, 0, 2);
      line += 64;
      if (line > last) {
        line = nullptr;
        if (value) ++j;
        value = !value;
      }
    }
  }
};

// Eight keys at a time; the last group repeats the last key (its extra scores land in the chunk's
// padding, which the softmax masks), so that every score is summed the same way.
template <int GN, int W, typename KT>
static void scores_group(const float* q, const KT* const* kp, int64_t off, int n, int64_t D, float* s,
                         const Prefetch<KT>& pf, NextItem<KT>* next) {
  for (int j = 0; j < n; j += 8) {
    for (int i = 0; i < 8; ++i) prefetch_key(pf, j + i + kPrefetchAhead);
    if (next != nullptr) next->step(8);
    if (j + 8 <= n) {
      scores8<GN, W>(q, kp + j, off, D, s + j);
    } else {
      const KT* last[8];
      for (int i = 0; i < 8; ++i) last[i] = kp[std::min(j + i, n - 1)];
      scores8<GN, W>(q, last, off, D, s + j);
    }
  }
}

// Vectors of V per pass over the keys for GN heads: AVX-512's 32 registers hold 4 x 4 heads'
// accumulators; AVX2's 16 hold 4 x 3 (with the three weights and a V vector), or 2 x 4.
constexpr int pv_vectors_per_pass(int64_t heads) {
#if defined(__AVX512F__)
  return 4;
#else
  return heads <= 3 ? 4 : 2;
#endif
}

// Where P . V finds p[g][j]: at p + g * row + j * key (the one-token path's rows of kChunk scores, or
// a tile's scores with its rows along the vector lanes)
struct Strides {
  int64_t row, key;
};
constexpr Strides kRowMajor{kChunk, 1};

// acc[g][d] += sum_j p[g][j] * v_j[d] over d = d0, d0 + NV * W, ... while NV W-wide vectors fit in
// D, for GN heads (v_j = vp[j] + off; p[g][j] at p + g * P.row + j * P.key); returns where it
// stopped. Every element sums its keys in order j = 0, 1, ..., whatever the width. vp[0 : valid] are
// the item's slots from this chunk on: the rows kValuePrefetchAhead keys on are prefetched, into the
// next chunk.
template <int GN, int W, int NV, typename KT>
TM_INLINE int64_t pv_vectors(const float* p, Strides P, const KT* const* vp, int64_t valid, int64_t off, int n,
                             int64_t d0, int64_t D, float* acc, NextItem<KT>* next) {
  using V = typename Vec<W>::type;
  int64_t d = d0;
  for (; d + NV * W <= D; d += NV * W) {
    V a[NV][GN];
    for (int g = 0; g < GN; ++g)
      for (int v = 0; v < NV; ++v) a[v][g] = Vec<W>::load(acc + g * D + d + v * W);
    for (int j = 0; j < n; ++j) {
      if (next != nullptr) next->step();
      if (j + kValuePrefetchAhead < valid) {
        const char* ahead = reinterpret_cast<const char*>(vp[j + kValuePrefetchAhead] + off + d);
        for (int b = 0; b < NV * W * int(sizeof(KT)); b += 64) __builtin_prefetch(ahead + b, 0, 3);
      }
      V w[GN];
      for (int g = 0; g < GN; ++g) w[g] = Vec<W>::splat(p[g * P.row + j * P.key]);
      for (int v = 0; v < NV; ++v) {  // one V vector live at a time
        const V x = Vec<W>::load(vp[j] + off + d + v * W);
        for (int g = 0; g < GN; ++g) a[v][g] += w[g] * x;
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int v = 0; v < NV; ++v) std::memcpy(acc + g * D + d + v * W, &a[v][g], sizeof(V));
  }
  return d;
}

template <int GN, int W, typename KT>
static void pv_group(const float* p, Strides P, const KT* const* vp, int64_t valid, int64_t off, int n, int64_t D,
                     float* acc, NextItem<KT>* next = nullptr) {
  int64_t d = pv_vectors<GN, W, pv_vectors_per_pass(GN)>(p, P, vp, valid, off, n, 0, D, acc, next);
  d = pv_vectors<GN, W, 1>(p, P, vp, valid, off, n, d, D, acc, next);
  for (; d < D; ++d) {
    for (int g = 0; g < GN; ++g) {
      float a = acc[g * D + d];
      for (int j = 0; j < n; ++j) a += p[g * P.row + j * P.key] * to_f32(vp[j][off + d]);
      acc[g * D + d] = a;
    }
  }
}

template <int W, typename KT>
static void scores_all(const float* q, const KT* const* kp, int64_t off, int n, int64_t G, int64_t D, float* s,
                       const Prefetch<KT>& pf, NextItem<KT>* next) {
  const Prefetch<KT> none;
  for (int64_t g0 = 0; g0 < G; g0 += kScoreGroup) {
    const float* qg = q + g0 * D;
    float* sg = s + g0 * kChunk;
    const Prefetch<KT>& p = g0 == 0 ? pf : none;  // the first pass over the keys prefetches
    switch (std::min<int64_t>(kScoreGroup, G - g0)) {
      case 1: scores_group<1, W>(qg, kp, off, n, D, sg, p, next); break;
      case 2: scores_group<2, W>(qg, kp, off, n, D, sg, p, next); break;
      default: scores_group<3, W>(qg, kp, off, n, D, sg, p, next); break;
    }
  }
}

template <int W, typename KT>
static void pv_all(const float* p, const KT* const* vp, int64_t valid, int64_t off, int n, int64_t G, int64_t D,
                   float* acc, NextItem<KT>* next) {
  for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup) {
    const float* pg = p + g0 * kChunk;
    float* ag = acc + g0 * D;
    switch (std::min<int64_t>(kMaxGroup, G - g0)) {
      case 1: pv_group<1, W>(pg, kRowMajor, vp, valid, off, n, D, ag, next); break;
      case 2: pv_group<2, W>(pg, kRowMajor, vp, valid, off, n, D, ag, next); break;
      case 3: pv_group<3, W>(pg, kRowMajor, vp, valid, off, n, D, ag, next); break;
      default: pv_group<4, W>(pg, kRowMajor, vp, valid, off, n, D, ag, next); break;
    }
  }
}

TM_INLINE int64_t wrap_clamp(int64_t i, int64_t n) {  // jnp indexing: wrap negatives once, clamp
  if (i < 0) i += n;
  return std::min<int64_t>(std::max<int64_t>(i, 0), n - 1);
}

struct Problem {
  int64_t T, H, D, KVH, G, N, B, R, M;
  int64_t layer;
  int64_t window;  // visible: p > pos - window (int32 max when there is none)
  float scale;
  const float* sinks;  // [H]: per-head logits in every softmax denominator (-inf: none)
  int64_t span;  // kv heads per work item (1 or KVH)
  // the split path (else null): token t's kv heads times its chunks are items chunk_items[t] ..
  // chunk_items[t + 1] - 1, and their results go to partials [T][max_chunks][H][2 + D] (each chunk's
  // max, sum, then P . V)
  const int64_t* chunk_items = nullptr;
  float* partials = nullptr;
  int64_t max_chunks = 0;
  const int32_t* positions;
  const int32_t* token_request;
  const int32_t* block_tables;
};

struct Visible {
  int64_t lo, hi;
  bool uniform;
  int64_t len() const { return hi - lo + 1; }
};

// The keys token t sees, [lo, hi] (empty when lo > hi: the one-token path averages all of V then)
TM_INLINE Visible token_keys(const Problem& pb, int64_t t) {
  const int64_t pos = pb.positions[t];
  return {std::max<int64_t>(0, pos - pb.window + 1), std::min<int64_t>(pos, pb.M * pb.B - 1), false};
}

template <typename KT>
struct Scratch {
  std::vector<float> q, acc, s, m, l;
  std::vector<float> mc, lc, cacc;  // one chunk's max, sum and P . V, per query head
  std::vector<const KT*> kp, vp;  // slot pointers of the visible keys
  std::vector<const KT*> next_kp, next_vp;  // those of the item this thread runs next
  int64_t next_item = -1;  // that item (its slots are reused when it runs)
  Visible next_vis{};
  int64_t next_fetched = 0;  // its first keys fetched ahead (their K and V rows)
  explicit Scratch(const Problem& pb)
      : q(pb.span * pb.G * pb.D), acc(pb.span * pb.G * pb.D), s(pb.span * pb.G * kChunk), m(pb.span * pb.G),
        l(pb.span * pb.G), mc(pb.span * pb.G), lc(pb.span * pb.G), cacc(pb.span * pb.G * pb.D), kp(kChunk),
        vp(kChunk), next_kp(kChunk), next_vp(kChunk) {}
};

// The slots (all kv heads) of request `request`'s keys [vis.lo, vis.hi] in kp / vp, grown to fit.
template <typename KT>
static void slots_of(const Problem& pb, int64_t request, const Visible& vis, const KT* kc, const KT* vc,
                     std::vector<const KT*>& kp, std::vector<const KT*>& vp) {
  const int32_t* table = pb.block_tables + wrap_clamp(request, pb.R) * pb.M;
  const int64_t row_stride = pb.KVH * pb.D;  // between consecutive slots of a block
  const int64_t layer_base = pb.layer * pb.N * pb.B * row_stride;
  if (int64_t(kp.size()) < vis.len()) kp.resize(vis.len()), vp.resize(vis.len());
  for (int64_t p = vis.lo; p <= vis.hi;) {  // block by block
    const int64_t bi = p / pb.B;
    const int64_t first = layer_base + (wrap_clamp(table[bi], pb.N) - bi) * pb.B * row_stride;  // + p * row_stride
    for (const int64_t end = std::min(vis.hi, (bi + 1) * pb.B - 1); p <= end; ++p) {
      kp[p - vis.lo] = kc + (first + p * row_stride);
      vp[p - vis.lo] = vc + (first + p * row_stride);
    }
  }
}

// What a work item covers: token t, kv heads [kh0, kh0 + span), and on the split path chunk `chunk` of
// the token's keys (-1: all of them)
struct ItemKeys {
  int64_t t, kh0, chunk;
};

TM_INLINE ItemKeys item_keys(const Problem& pb, int64_t item) {
  if (pb.chunk_items == nullptr) {
    const int64_t per_token = pb.KVH / pb.span;
    return {item / per_token, (item % per_token) * pb.span, -1};
  }
  int64_t t = 0;  // (few tokens)
  while (pb.chunk_items[t + 1] <= item) ++t;
  const int64_t chunks = (pb.chunk_items[t + 1] - pb.chunk_items[t]) / pb.KVH, rel = item - pb.chunk_items[t];
  return {t, rel / chunks, rel % chunks};  // kv head by kv head, chunks in order
}

// The keys token t sees for its softmax: token_keys, or where it sees none (`uniform`) every key of its
// block-table row, averaged (the reference's all-masked softmax is a plain mean)
TM_INLINE Visible softmax_keys(const Problem& pb, int64_t t) {
  Visible vis = token_keys(pb, t);
  vis.uniform = vis.lo > vis.hi;
  if (vis.uniform) vis.lo = 0, vis.hi = pb.M * pb.B - 1;
  return vis;
}

// The keys item `it` sees: [lo, hi] (`uniform`: none, so every key, averaged), and the slot of each
// (all kv heads) in kp / vp.
template <typename KT>
static Visible visible_slots(const Problem& pb, const ItemKeys& it, const KT* kc, const KT* vc,
                             std::vector<const KT*>& kp, std::vector<const KT*>& vp) {
  Visible vis = softmax_keys(pb, it.t);
  if (it.chunk >= 0) {
    vis.lo += it.chunk * kChunk;
    vis.hi = std::min(vis.hi, vis.lo + kChunk - 1);
  }
  slots_of(pb, pb.token_request[it.t], vis, kc, vc, kp, vp);
  return vis;
}

// l * alpha + h, rounded once where the target has FMA: spelled out, so that every fold rounds alike (a
// scalar a * b + c is the compiler's to fuse or not, place by place)
TM_INLINE float rescaled_sum(float l, float alpha, float h) {
#if defined(__FMA__)
  return std::fma(l, alpha, h);
#else
  return l * alpha + h;
#endif
}

// One chunk of one row's softmax, on its own: the scores s[0 : padded) (padded a multiple of W, masked
// scores -inf) become exp(s - mc) for mc their max, and lc is their sum. A row with every score masked
// (a tile's token whose keys ended before the chunk) gets mc = -inf, exp 0 and lc = 0.
template <int W>
TM_INLINE void chunk_softmax(float* s, int padded, float& mc, float& lc) {
  using V = typename Vec<W>::type;
  V vmax = Vec<W>::load(s);
  for (int j = W; j < padded; j += W) {
    const V x = Vec<W>::load(s + j);
    vmax = x > vmax ? x : vmax;
  }
  float cmax = vmax[0];
  for (int j = 1; j < W; ++j) cmax = std::max(cmax, vmax[j]);
  const V sub = Vec<W>::splat(cmax == -std::numeric_limits<float>::infinity() ? 0.0f : cmax);
  V vsum{};
  for (int j = 0; j < padded; j += W) {
    const V e = expv<W>(Vec<W>::load(s + j) - sub);
    std::memcpy(s + j, &e, sizeof(e));
    vsum += e;
  }
  mc = cmax;
  lc = hsum(Vec<W>::fold(vsum));
}

// A chunk's max mc, sum lc and P . V cacc[0 : D) folded into a row's running max m, sum l and acc: all
// rescaled to m' = max(m, mc), then added. Every path folds a token's chunks in order through this,
// whether one item ran them all or each ran on its own (the split path), so a token gets the same bits
// whatever it is batched with.
TM_INLINE void fold_chunk(float& m, float& l, float* acc, float mc, float lc, const float* cacc, int64_t D) {
  if (mc == -std::numeric_limits<float>::infinity()) return;  // no key in this chunk: nothing to add
  const float mnew = std::max(m, mc);
  const float a = std::exp(m - mnew);  // 0 on the first chunk (m = -inf)
  const float b = std::exp(mc - mnew);
  l = rescaled_sum(l, a, lc * b);
  for (int64_t d = 0; d < D; ++d) acc[d] = rescaled_sum(acc[d], a, cacc[d] * b);
  m = mnew;
}

// A row's output: acc / (l + exp(sink - m)) (a sink adds to the denominator, nothing to V; none for a
// token that sees no key)
template <typename QT>
TM_INLINE void finish_row(const float* acc, float m, float l, float sink, bool uniform, int64_t D, QT* out) {
  const float inv = 1.0f / (uniform ? l : l + std::exp(sink - m));
  for (int64_t d = 0; d < D; ++d) store_f32(acc[d] * inv, out + d);
}

// One work item: token t and kv heads [kh0, kh0 + span) → out[t, kh0*G : (kh0+span)*G, :], or on the
// split path one chunk of the token's keys for kv head kh0 → its results in pb.partials.
// All kv heads of a slot lie side by side in the cache, so an item over every kv head reads each
// block as one contiguous stretch (prefetcher-friendly); single kv heads give more items when
// there are few tokens. W: the width of the vectors that q meets K and P meets V on.
template <int W, typename QT, typename KT>
static void attend(const Problem& pb, const QT* q, const KT* kc, const KT* vc, QT* out, int64_t item,
                   int64_t following, Scratch<KT>& sc) {
  const ItemKeys it = item_keys(pb, item);
  const int64_t t = it.t, kh0 = it.kh0;
  const int64_t G = pb.G, D = pb.D, ctx = pb.M * pb.B;
  const int64_t heads = pb.span * G;  // query heads of this item
  const QT* qt = q + (t * pb.H + kh0 * G) * D;
  QT* ot = out + (t * pb.H + kh0 * G) * D;
  if (ctx == 0) {  // (never on the split path)
    for (int64_t i = 0; i < heads * D; ++i) store_f32(0.0f, ot + i);
    return;
  }
  float* qf = sc.q.data();
  for (int64_t i = 0; i < heads * D; ++i) qf[i] = to_f32(qt[i]) * pb.scale;
  float* acc = sc.acc.data();
  std::fill(sc.acc.begin(), sc.acc.end(), 0.0f);
  float* m = sc.m.data();
  float* l = sc.l.data();
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.0f);
  float* s = sc.s.data();
  Visible vis;
  int64_t fetched = 0;  // keys whose rows the previous item fetched ahead
  if (sc.next_item == item) {  // fetched ahead as the previous item's next: its slots are known
    std::swap(sc.kp, sc.next_kp), std::swap(sc.vp, sc.next_vp);
    vis = sc.next_vis;
    fetched = sc.next_fetched;
  } else {
    vis = visible_slots(pb, it, kc, vc, sc.kp, sc.vp);
  }
  const int64_t lo = vis.lo, hi = vis.hi, len = vis.len();
  const bool uniform = vis.uniform;
  const KT** kp = sc.kp.data();
  const KT** vp = sc.vp.data();
  NextItem<KT> next;
  int64_t next_len = 0;
  if (following >= 0) {
    next.bytes = int64_t(sizeof(KT)) * pb.span * D;
    sc.next_item = following;
    const ItemKeys after = item_keys(pb, following);
    sc.next_vis = visible_slots(pb, after, kc, vc, sc.next_kp, sc.next_vp);
    next_len = std::min<int64_t>(sc.next_vis.len(), kNextItemBytes / (2 * next.bytes));
    sc.next_fetched = next_len;
    next.kp = sc.next_kp.data(), next.vp = sc.next_vp.data();
    next.off = after.kh0 * D;
    next.count = next_len;
    // spread over this item's steps: 8 per group of 8 keys scored, 1 per key of each pass of P . V
    int64_t pv_passes = 0;  // over all of pv_all's groups of heads
    for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup) {
      const int64_t width = pv_vectors_per_pass(std::min<int64_t>(kMaxGroup, G - g0)) * W;
      pv_passes += D / width + D % width / W;
    }
    const int64_t steps = pb.span * ((uniform ? 0 : (G + kScoreGroup - 1) / kScoreGroup * (len + 7) / 8 * 8) +
                                     pv_passes * len);
    const int64_t lines = next_len * 2 * (next.bytes / 64 + 1);
    next.per_step = steps > 0 ? lines / steps + 1 : 0;
  }
  const int64_t item_bytes = int64_t(sizeof(KT)) * pb.span * D;
  for (int64_t j = fetched; j < std::min<int64_t>(kPrefetchAhead, len); ++j) {
    prefetch_key(Prefetch<KT>{kp, len, kh0 * D, item_bytes}, j);
  }

  for (int64_t c0 = lo; c0 <= hi; c0 += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, hi - c0 + 1));
    const KT* const* ck = kp + (c0 - lo);
    const KT* const* cv = vp + (c0 - lo);
    if (uniform) {
      for (int64_t g = 0; g < heads; ++g) std::fill(s + g * kChunk, s + g * kChunk + n, 0.0f);
    } else {
      const bool ahead = c0 - lo + kChunk + kPrefetchAhead > fetched;  // else the keys are in L2 already
      const Prefetch<KT> pf = ahead ? Prefetch<KT>{ck, hi - c0 + 1, kh0 * D, item_bytes} : Prefetch<KT>{};
      for (int64_t k = 0; k < pb.span; ++k)
        scores_all<W, KT>(qf + k * G * D, ck, (kh0 + k) * D, n, G, D, s + k * G * kChunk, k == 0 ? pf : Prefetch<KT>{},
                          next.kp != nullptr ? &next : nullptr);
    }
    const int padded = (n + W - 1) / W * W;  // kChunk is a multiple of W: within the head's scores
    float *mc = sc.mc.data(), *lc = sc.lc.data(), *cacc = sc.cacc.data();
    for (int64_t g = 0; g < heads; ++g) {
      std::fill(s + g * kChunk + n, s + g * kChunk + padded, -std::numeric_limits<float>::infinity());
      chunk_softmax<W>(s + g * kChunk, padded, mc[g], lc[g]);
    }
    std::fill(cacc, cacc + heads * D, 0.0f);
    for (int64_t k = 0; k < pb.span; ++k)
      pv_all<W, KT>(s + k * G * kChunk, cv, hi - c0 + 1, (kh0 + k) * D, n, G, D, cacc + k * G * D,
                    next.kp != nullptr ? &next : nullptr);
    for (int64_t g = 0; g < heads; ++g) {
      if (it.chunk < 0) {
        fold_chunk(m[g], l[g], acc + g * D, mc[g], lc[g], cacc + g * D, D);
      } else {  // the split path: folded by the caller, in order, after every chunk has run
        float* part = pb.partials + ((t * pb.max_chunks + it.chunk) * pb.H + kh0 * G + g) * (2 + D);
        part[0] = mc[g], part[1] = lc[g];
        std::memcpy(part + 2, cacc + g * D, D * sizeof(float));
      }
    }
  }
  if (it.chunk >= 0) return;
  for (int64_t g = 0; g < heads; ++g)
    finish_row(acc + g * D, m[g], l[g], pb.sinks[kh0 * G + g], uniform, D, ot + g * D);
}

// Prefill tiles. The consecutive tokens of a prompt see nearly the same keys: up to kTileTokens of them
// (one request, consecutive positions, each seeing its keys from position 0 on) are one work item, which
// meets each chunk of keys with all its tokens while the chunk is in L1: each K row is read from memory
// once per tile instead of once per token, and P . V runs kTilePvRows query heads at a time on each V
// row instead of one token's. A token's arithmetic is the one-token path's, in the same order (scores
// by tile_scores, which sums each as scores8 does, or by scores_all itself where the head size is not a
// multiple of the vector width; each chunk's softmax by chunk_softmax or its rows-along-the-lanes twin,
// folded by fold_chunk, chunks from position 0; the keys a shorter row does not see add exact zeros to
// P . V), so its result is bit for bit the same in a tile or alone: greedy output does not depend on how
// a prompt is chunked or batched. (Tokens whose window starts past 0 take the one-token path, whose
// chunks start at the window.)
constexpr int kTileTokens = 16;
#if defined(__AVX512F__)
constexpr int kTilePvRows = 6;  // P . V: 6 rows x 4 vectors of V in AVX-512's 32 registers
#else
constexpr int kTilePvRows = 2;  // of AVX2's 16
#endif

struct Tile {
  int64_t t0, n;  // tokens [t0, t0 + n)
};

// Whether token t can join a tile: it sees keys, from position 0 on
TM_INLINE bool tiles_with(const Problem& pb, int64_t t) {
  const Visible keys = token_keys(pb, t);
  return keys.lo == 0 && keys.len() > 0;
}

// The batch's tokens as tiles: runs of up to kTileTokens tokens of one request at consecutive positions
// that can join a tile; any other token is a tile of its own (n = 1: the one-token path)
static std::vector<Tile> tiles_of(const Problem& pb) {
  std::vector<Tile> tiles;
  auto joins = [&](int64_t t, int64_t n) {  // whether token t + n extends the tile [t, t + n)
    return pb.token_request[t + n] == pb.token_request[t] &&
           int64_t(pb.positions[t + n]) == int64_t(pb.positions[t]) + n && tiles_with(pb, t + n);
  };
  for (int64_t t = 0; t < pb.T;) {
    int64_t n = 1;
    if (tiles_with(pb, t))
      while (n < kTileTokens && t + n < pb.T && joins(t, n)) ++n;
    tiles.push_back({t, n});
    t += n;
  }
  return tiles;
}

template <typename KT>
struct TileScratch {
  // one row per query head of the tile (rows padded to whole kTilePvRows): token i, head g at i * G + g
  std::vector<float> q, s, acc, m, l;  // q [rows][D] scaled, s [rows][kChunk], acc [rows][D]
  std::vector<float> mc, lc, cacc;  // one chunk's max, sum and P . V per row
  // with the rows along the vector lanes (tile_scores, chunk_softmax_lanes): q [D][lanes], s [kChunk][lanes]
  // for lanes the rows padded to whole kTilePvRows, then to whole vectors
  std::vector<float> qt, st;
  std::vector<const KT*> kp, vp;  // slot pointers of the tile's keys
  explicit TileScratch(const Problem& pb) {
    const int64_t rows = (kTileTokens * pb.G + kTilePvRows - 1) / kTilePvRows * kTilePvRows;
    const int64_t lanes = (rows + kWide - 1) / kWide * kWide;
    q.resize(rows * pb.D), s.resize(rows * kChunk), acc.resize(rows * pb.D), m.resize(lanes), l.resize(lanes);
    mc.resize(lanes), lc.resize(lanes), cacc.resize(rows * pb.D);
    qt.resize(pb.D * lanes), st.resize(kChunk * lanes);
  }
};

// Vec<W>::fold for W vectors whose lanes are rows, each vector one lane of the one-token path's: out[i] =
// in[i] + in[i + 8] (16-wide), in[i] (8-wide), i < 8
template <int W>
TM_INLINE void fold_across(const typename Vec<W>::type* in, typename Vec<W>::type* out) {
  for (int i = 0; i < 8; ++i) {
    if constexpr (W == 16)
      out[i] = in[i] + in[i + 8];
    else
      out[i] = in[i];
  }
}

// The scores of a tile's rows for keys [0, n) of a chunk, with the rows along the vector lanes: st[j *
// lanes + r] = q_r . k_j for q's rows transposed in qt [D][lanes] (lanes: the rows padded to whole W-wide
// vectors). Each score is summed exactly as scores8 sums it for one token (which takes the head along
// the lanes instead): lane l of the head, l < W, is a chain of multiply-adds over d = l, l + W, ...
// (D a multiple of W), a 16-wide build then adds lanes l and l + 8, and the eight sums meet in
// reduce8's tree, ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). So a token's scores are bit for bit
// its one-token scores, without the one-token path's horizontal sums: a key costs D multiply-adds and
// 15 adds per W rows.
template <int W, typename KT>
static void tile_scores(const float* qt, int64_t lanes, const KT* const* ck, int64_t off, int n, int64_t D, float* st) {
  using V = typename Vec<W>::type;
  for (int64_t r0 = 0; r0 < lanes; r0 += W) {
    for (int j = 0; j < n; ++j) {
      const KT* k = ck[j] + off;
      V p[W];
      for (int e = 0; e < W; ++e) p[e] = V{};
      for (int64_t d = 0; d < D; d += W)
        for (int e = 0; e < W; ++e) p[e] += Vec<W>::load(qt + (d + e) * lanes + r0) * Vec<W>::splat(to_f32(k[d + e]));
      V x[8];
      fold_across<W>(p, x);
      const V score = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
      std::memcpy(st + j * lanes + r0, &score, sizeof(V));
    }
  }
}

// chunk_softmax for each of rows [0, rows) of a tile's scores with the rows along the lanes (st [padded][lanes],
// masked scores -inf), in chunk_softmax's arithmetic row by row: the max (exact in any order), e = expv
// lane by lane, and the sum of e as chunk_softmax sums it (its lane t: keys t, t + W, ... in order; then
// the halves folded and hsum's tree). Lanes past `rows` hold garbage after it.
template <int W>
static void chunk_softmax_lanes(float* st, int64_t lanes, int64_t rows, int padded, float* mc, float* lc) {
  using V = typename Vec<W>::type;
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    float* col = st + r0;
    V vmax = Vec<W>::load(col);
    for (int j = 1; j < padded; ++j) {
      const V x = Vec<W>::load(col + j * lanes);
      vmax = x > vmax ? x : vmax;
    }
    float sub[W];
    for (int e = 0; e < W; ++e)
      sub[e] = r0 + e < rows && vmax[e] != -std::numeric_limits<float>::infinity() ? vmax[e] : 0.0f;
    const V vs = Vec<W>::load(sub);
    V part[W];
    for (int t = 0; t < W; ++t) part[t] = V{};
    for (int j0 = 0; j0 < padded; j0 += W)
      for (int t = 0; t < W; ++t) {
        const V e = expv<W>(Vec<W>::load(col + (j0 + t) * lanes) - vs);
        std::memcpy(col + (j0 + t) * lanes, &e, sizeof(e));
        part[t] += e;
      }
    V y[8];
    fold_across<W>(part, y);
    const V h = ((y[0] + y[4]) + (y[1] + y[5])) + ((y[2] + y[6]) + (y[3] + y[7]));
    for (int e = 0; e < W && r0 + e < rows; ++e) mc[r0 + e] = vmax[e], lc[r0 + e] = h[e];
  }
}

// One tile (all kv heads) → out[t0 : t0 + n]
template <int W, typename QT, typename KT>
static void attend_tile(const Problem& pb, const QT* q, const KT* kc, const KT* vc, QT* out, const Tile& tile,
                        TileScratch<KT>& sc) {
  const int64_t G = pb.G, D = pb.D, rows = tile.n * G;
  const int64_t pv_rows = (rows + kTilePvRows - 1) / kTilePvRows * kTilePvRows;
  const int64_t hi = token_keys(pb, tile.t0 + tile.n - 1).hi;  // the last token's last key (the first's: 0)
  slots_of(pb, pb.token_request[tile.t0], Visible{0, hi, false}, kc, vc, sc.kp, sc.vp);
  float *qf = sc.q.data(), *s = sc.s.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  float *mc = sc.mc.data(), *lc = sc.lc.data(), *cacc = sc.cacc.data();
  std::fill(s + rows * kChunk, s + pv_rows * kChunk, 0.0f);  // padding rows: no keys
  const Prefetch<KT> no_prefetch;
  const bool transposed = D % W == 0;  // the rows along the lanes (else scores_all, token by token)
  const int64_t lanes = (pv_rows + W - 1) / W * W;
  float *qt = sc.qt.data(), *st = sc.st.data();
  for (int64_t kh = 0; kh < pb.KVH; ++kh) {
    for (int64_t i = 0; i < tile.n; ++i) {
      const QT* qi = q + ((tile.t0 + i) * pb.H + kh * G) * D;  // the token's G heads of this kv head
      for (int64_t e = 0; e < G * D; ++e) qf[i * G * D + e] = to_f32(qi[e]) * pb.scale;
    }
    if (transposed)
      for (int64_t d = 0; d < D; ++d)
        for (int64_t r = 0; r < lanes; ++r) qt[d * lanes + r] = r < rows ? qf[r * D + d] : 0.0f;
    std::fill(acc, acc + pv_rows * D, 0.0f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    for (int64_t c0 = 0; c0 <= hi; c0 += kChunk) {
      const int n = int(std::min<int64_t>(kChunk, hi - c0 + 1));  // the last token's keys in this chunk
      const KT* const* ck = sc.kp.data() + c0;
      const KT* const* cv = sc.vp.data() + c0;
      if (transposed) {
        // every row's scores for all n keys, those past a token's own masked; the softmax and P . V on them
        tile_scores<W, KT>(qt, lanes, ck, kh * D, n, D, st);
        const int padded = (n + W - 1) / W * W;
        for (int64_t i = 0; i < tile.n; ++i) {
          const int64_t own = std::max<int64_t>(0, token_keys(pb, tile.t0 + i).hi - c0 + 1);
          for (int64_t j = std::min<int64_t>(own, padded); j < padded; ++j)
            for (int64_t r = i * G; r < (i + 1) * G; ++r) st[j * lanes + r] = -std::numeric_limits<float>::infinity();
        }
        chunk_softmax_lanes<W>(st, lanes, rows, padded, mc, lc);
        for (int j = 0; j < n; ++j) std::fill(st + j * lanes + rows, st + j * lanes + pv_rows, 0.0f);  // no rows
        std::fill(cacc, cacc + pv_rows * D, 0.0f);
        for (int64_t r0 = 0; r0 < pv_rows; r0 += kTilePvRows)
          pv_group<kTilePvRows, W>(st + r0, Strides{1, lanes}, cv, hi - c0 + 1, kh * D, n, D, cacc + r0 * D);
        for (int64_t r = 0; r < rows; ++r) fold_chunk(m[r], l[r], acc + r * D, mc[r], lc[r], cacc + r * D, D);
        continue;
      }
      for (int64_t i = 0; i < tile.n; ++i) {
        float* si = s + i * G * kChunk;
        const int64_t own = token_keys(pb, tile.t0 + i).hi - c0 + 1;  // this token's keys in the chunk
        if (own <= 0) {  // none: the token's chunks ended before this one
          std::fill(si, si + G * kChunk, 0.0f);
          std::fill(mc + i * G, mc + (i + 1) * G, -std::numeric_limits<float>::infinity());
          continue;
        }
        const int ni = int(std::min<int64_t>(kChunk, own));
        scores_all<W, KT>(qf + i * G * D, ck, kh * D, ni, G, D, si, no_prefetch, nullptr);
        const int padded = (ni + W - 1) / W * W;
        for (int64_t g = 0; g < G; ++g) {
          float* sg = si + g * kChunk;
          std::fill(sg + ni, sg + padded, -std::numeric_limits<float>::infinity());
          chunk_softmax<W>(sg, padded, mc[i * G + g], lc[i * G + g]);
          std::fill(sg + padded, sg + std::max(padded, n), 0.0f);  // keys past the token's: p = 0
        }
      }
      std::fill(cacc, cacc + pv_rows * D, 0.0f);
      for (int64_t r0 = 0; r0 < pv_rows; r0 += kTilePvRows)  // the one-token path's P . V, more rows
        pv_group<kTilePvRows, W>(s + r0 * kChunk, kRowMajor, cv, hi - c0 + 1, kh * D, n, D, cacc + r0 * D);
      for (int64_t r = 0; r < rows; ++r) fold_chunk(m[r], l[r], acc + r * D, mc[r], lc[r], cacc + r * D, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = kh * G + r % G;
      finish_row(acc + r * D, m[r], l[r], pb.sinks[head], false, D, out + ((tile.t0 + r / G) * pb.H + head) * D);
    }
  }
}

template <typename KT>
struct TileState {
  Scratch<KT> one;  // for tiles of one token
  TileScratch<KT> tile;
  explicit TileState(const Problem& pb) : one(pb), tile(pb) {}
};

// A batch cut into tiles (pb.span = KVH: one item per token on the one-token path)
template <int W, typename QT, typename KT>
static void run_tiles(ffi::ThreadPool& pool, const Problem& pb, const std::vector<Tile>& tiles, const QT* q,
                      const KT* kc, const KT* vc, QT* out) {
  parallel_for<TileState<KT>>(
      pool, int64_t(tiles.size()), [&pb] { return std::make_unique<TileState<KT>>(pb); },
      [&](int64_t i, int64_t following, TileState<KT>& state) {
        const Tile& tile = tiles[i];
        if (tile.n > 1) {
          if (following >= 0) {  // the next tile's queries, into L2 (else the first kv head waits on them)
            const Tile& next = tiles[following];
            const char* first = reinterpret_cast<const char*>(q + next.t0 * pb.H * pb.D);
            const int64_t bytes = next.n * pb.H * pb.D * int64_t(sizeof(QT));
            for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(first + b, 0, 2);
          }
          attend_tile<W, QT, KT>(pb, q, kc, vc, out, tile, state.tile);
        } else {  // the next item's keys are fetched ahead where it is one token too
          const int64_t next = following >= 0 && tiles[following].n == 1 ? tiles[following].t0 : -1;
          attend<W, QT, KT>(pb, q, kc, vc, out, tile.t0, next, state.one);
        }
      });
}

// The split path's last part: token t's chunks folded in order, as one item would have folded them
template <typename QT>
static void fold_partials(const Problem& pb, int64_t t, std::vector<float>& acc, QT* out) {
  const int64_t chunks = (pb.chunk_items[t + 1] - pb.chunk_items[t]) / pb.KVH;
  const bool uniform = softmax_keys(pb, t).uniform;
  acc.resize(pb.D);
  for (int64_t h = 0; h < pb.H; ++h) {
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = pb.partials + ((t * pb.max_chunks + c) * pb.H + h) * (2 + pb.D);
      fold_chunk(m, l, acc.data(), part[0], part[1], part + 2, pb.D);
    }
    finish_row(acc.data(), m, l, pb.sinks[h], uniform, pb.D, out + (t * pb.H + h) * pb.D);
  }
}

template <int W, typename QT, typename KT>
static void run_width(ffi::ThreadPool& pool, const Problem& pb, const QT* q, const KT* kc, const KT* vc, QT* out) {
  if (pb.chunk_items != nullptr) {  // few tokens: each kv head and chunk of their keys, then the folds
    parallel_for<Scratch<KT>>(
        pool, pb.chunk_items[pb.T], [&pb] { return std::make_unique<Scratch<KT>>(pb); },
        [&](int64_t i, int64_t following, Scratch<KT>& scratch) {
          attend<W, QT, KT>(pb, q, kc, vc, out, i, following, scratch);
        },
        /*spin=*/true);
    struct Fold {
      std::vector<float> acc;
    };
    parallel_for<Fold>(
        pool, pb.T, [] { return std::make_unique<Fold>(); },
        [&](int64_t t, Fold& fold) { fold_partials(pb, t, fold.acc, out); }, /*spin=*/true);
    return;
  }
  if (pb.span == pb.KVH) {  // prefills: their tokens in tiles
    const std::vector<Tile> tiles = tiles_of(pb);
    // Tiles are whole work items: fewer tiles of several tokens than two per thread would leave
    // threads idle (a step verifying one request's speculative tokens is one tile), so then each
    // token is an item, its keys re-read from cache (SmolLM2 float32, a step of one request's 5 tokens
    // at 320 keys, one run each: 1.31-1.36x the time of a 1-token step -> 1.22-1.24x).
    const int64_t multi = std::count_if(tiles.begin(), tiles.end(), [](const Tile& t) { return t.n > 1; });
    if (multi >= 2 * std::max<int64_t>(1, pool.num_threads())) return run_tiles<W>(pool, pb, tiles, q, kc, vc, out);
  }
  const int64_t items = pb.T * (pb.KVH / pb.span);
  parallel_for<Scratch<KT>>(
      pool, items, [&pb] { return std::make_unique<Scratch<KT>>(pb); },
      [&](int64_t i, int64_t following, Scratch<KT>& scratch) {
        attend<W, QT, KT>(pb, q, kc, vc, out, i, following, scratch);
      },
      /*spin=*/pb.T <= 4);  // decoding a few sequences: short calls between the projections' GEMVs
}

template <typename QT, typename KT>
static void run(ffi::ThreadPool& pool, Problem pb, const QT* q, const KT* kc, const KT* vc, QT* out) {
  const int64_t threads_available = std::max<int64_t>(1, pool.num_threads());
  pb.span = pb.T >= 4 * threads_available ? pb.KVH : 1;
  // Fewer tokens than two a thread (a single stream's decode step): each token's keys are cut into
  // their chunks, and each kv head and chunk is an item (the split path), their results folded in order
  // afterwards. One item per kv head left one of two threads with two of SmolLM2's three; items of a
  // chunk over all kv heads (whole slots, one contiguous stretch a block) balanced the threads but ran
  // no faster. SmolLM2 float32 decoding, the kernel's time per call at the median, alternated in one
  // process: ~150 keys 22.0 -> 19.1 us (all kv heads an item: 23.5), ~256 keys 30.3 -> 26.2 (31.7),
  // ~360 keys 39.7 -> 31.5 (34.7).
  thread_local std::vector<int64_t> chunk_items;  // kept across calls, like the partials
  thread_local std::vector<float> partials;
  if (pb.T < 2 * threads_available && threads_available > 1 && pb.M * pb.B > 0) {
    pb.span = 1;
    chunk_items.assign(pb.T + 1, 0);
    for (int64_t t = 0; t < pb.T; ++t) {
      const int64_t chunks = (softmax_keys(pb, t).len() + kChunk - 1) / kChunk;
      chunk_items[t + 1] = chunk_items[t] + chunks * pb.KVH;
      pb.max_chunks = std::max(pb.max_chunks, chunks);
    }
    partials.resize(pb.T * pb.max_chunks * pb.H * (2 + pb.D));
    pb.chunk_items = chunk_items.data();
    pb.partials = partials.data();
  }
  // 16-wide where the head size allows: SmolLM2 decoding at batch 64, 30 layers of 168 keys, 30.2 ->
  // 27.6 ms (19.3 -> 16.6 with the keys in cache)
  if (pb.D % kWide == 0)
    run_width<kWide>(pool, pb, q, kc, vc, out);
  else
    run_width<8>(pool, pb, q, kc, vc, out);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> token_request, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float scale) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || bd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: expected q [T,H,D], caches [L,N,B,KVH,D], tables [R,M]");
  if (v_cache.dimensions().size() != 5 || k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("paged_attention: k and v caches differ in rank or dtype");
  for (size_t i = 0; i < 5; ++i)
    if (kd[i] != v_cache.dimensions()[i]) return ffi::Error::InvalidArgument("paged_attention: k/v cache shapes differ");
  Problem pb;
  pb.T = qd[0], pb.H = qd[1], pb.D = qd[2];
  const int64_t L = kd[0];
  pb.N = kd[1], pb.B = kd[2], pb.KVH = kd[3];
  pb.R = bd[0], pb.M = bd[1];
  if (kd[4] != pb.D || pb.KVH <= 0 || pb.H % pb.KVH != 0 || L <= 0 || pb.N <= 0 || pb.B <= 0)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent head_dim / head counts / cache shape");
  if (positions.element_count() != size_t(pb.T) || token_request.element_count() != size_t(pb.T) ||
      layer.element_count() != 1 || window.element_count() != 1 || sinks.element_count() != size_t(pb.H))
    return ffi::Error::InvalidArgument("paged_attention: bad metadata shapes");
  if (pb.T > 0 && pb.R <= 0) return ffi::Error::InvalidArgument("paged_attention: empty block table");
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument("paged_attention: output must match q");
  pb.G = pb.H / pb.KVH;
  pb.layer = wrap_clamp(layer.typed_data()[0], L);
  pb.window = window.typed_data()[0];
  pb.scale = scale;
  pb.sinks = sinks.typed_data();
  pb.positions = positions.typed_data();
  pb.token_request = token_request.typed_data();
  pb.block_tables = block_tables.typed_data();

  const auto qt = q.element_type();
  auto kt = k_cache.element_type();
  if (kt == ffi::DataType::U16) kt = ffi::DataType::BF16;  // bfloat16 bits (ops/attention.py: BFLOAT16_BITS)
  const void* qp = q.untyped_data();
  const void* kp = k_cache.untyped_data();
  const void* vp = v_cache.untyped_data();
  void* op = out->untyped_data();
  using F32 = float;
  using B16 = uint16_t;
  if (qt == ffi::DataType::F32 && kt == ffi::DataType::F32) {
    run<F32, F32>(pool, pb, (const F32*)qp, (const F32*)kp, (const F32*)vp, (F32*)op);
  } else if (qt == ffi::DataType::F32 && kt == ffi::DataType::BF16) {
    run<F32, B16>(pool, pb, (const F32*)qp, (const B16*)kp, (const B16*)vp, (F32*)op);
  } else if (qt == ffi::DataType::BF16 && kt == ffi::DataType::F32) {
    run<B16, F32>(pool, pb, (const B16*)qp, (const F32*)kp, (const F32*)vp, (B16*)op);
  } else if (qt == ffi::DataType::BF16 && kt == ffi::DataType::BF16) {
    run<B16, B16>(pool, pb, (const B16*)qp, (const B16*)kp, (const B16*)vp, (B16*)op);
  } else {
    return ffi::Error::InvalidArgument("paged_attention: q and caches must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()  // k_cache [L, N, B, KVH, D]
                                  .Arg<ffi::AnyBuffer>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (int32 max: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_request [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, M]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [H] (-inf: none)
                                  .Ret<ffi::AnyBuffer>()  // out [T, H, D], dtype of q
                                  .Attr<float>("scale"));
