// --quantization w8a16_int / gguf_int: int8 weights (or GGUF's 4-bit codes) times x quantized to 16-bit
// integers, with integer dot products: AVX512-VNNI's VPDPBUSD where the CPU has it, else AVX2's VPMADDWD
// (below), else a portable loop.
//
// x is quantized per row and window of `wsz` values (the weights' scale window): step = max|x| /
// kInt16Steps (1 where the window is all zero), q = round(x / step), ties to even. A window's products
// are then exact integers; each is scaled into a float32 accumulator, window after window:
//
//   y[m, n] = fma(float(sum_k q[m, k] * w[k, n]), step[m, window] * scale[window, n], y[m, n])
//
// so a row's output is one chain whatever the rows beside it: batch-invariant, as the float paths are.
// (8-bit x alone, as llama.cpp's Q8_0 multiplies, moved SmolLM2's greedy output on five of the eight
// parity prompts; 16 bits keep what int8 weights with float32 inputs give.) The sums are exact
// whatever instructions make them, so every path below gives the same bits.
//
// The weights are stored in "quad strips" (made at load time, linear.py's `to_int8_quads`): strips of
// kStrip columns as elsewhere, each row of a strip holding 4 consecutive k of every column ([K / 4][32][4]
// bytes), each code stored plus 128, unsigned (what VPDPBUSD multiplies); the 128 * sum(q) this adds is
// taken off each window's sum again (the window sums of q are kept when x is quantized). 4-bit codes (0..15, value = code * scale +
// offset) need no such shift: their "nibble quad strips" hold 8 k a row, k in the low nibbles of a
// column's 4 bytes and k + 4 in the high ones, and each window adds its offsets times the window's sum
// of q. Every sum fits in int32 for windows of up to kMaxIntWindow.
//
// AVX512-VNNI's VPDPBUSD (64 multiply-adds of bytes an instruction, against a float32 FMA's 16)
// multiplies unsigned bytes by signed ones, four k at a time per int32 lane: each q is split into two
// int8, q = 254 * hi + lo (|hi|, |lo| <= 127), and a window's sum is 254 * sum(hi * w) + sum(lo * w),
// two dot products for each load of weights. AVX2 has no such instruction (its VPMADDUBSW saturates
// at 16 bits); VPMADDWD multiplies 16-bit integers pairwise into int32 lanes (16 multiply-adds an
// instruction), so there q, unsplit, multiplies the codes split into 16-bit lanes, each lane of the
// products a whole column (see split_codes).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "silu.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TOKENMILL_VNNI 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && !defined(TOKENMILL_VNNI)
#define TOKENMILL_AVX2_PAIRS 1  // VPMADDWD on pairs of q: pair_quads, split_codes, window_5x16
#endif

namespace {

constexpr int64_t kQuad = 4;  // k per group of bytes a VPDPBUSD lane sums
constexpr int64_t kQuadRowBytes = kStrip * kQuad;  // one row of a quad strip: 128 bytes
#if defined(TOKENMILL_AVX2_PAIRS)
constexpr int kDotTileRows = 5;  // rows per tile of the GEMM (AVX2: window_5x16)
#else
constexpr int kDotTileRows = 6;  // rows per tile of the GEMM (VNNI: 24 of the 32 vector registers hold sums)
#endif
constexpr int32_t kSplit = 254;  // q = kSplit * hi + lo
constexpr int32_t kInt16Steps = 127 * kSplit;  // the largest |q|
constexpr int64_t kMaxIntWindow = 512;  // wsz * kInt16Steps * 127 < 2^31

// x's rows quantized per window: q [M, K] (on VNNI builds split into hi and lo instead; on AVX2 builds
// each quad's middle two swapped, see pair_quads), with each window's step and sum of q ([K / wsz, M],
// window-major: a tile's rows side by side)
struct QuantizedRows {
#if defined(TOKENMILL_VNNI)
  std::vector<int8_t> hi, lo;
#else
  std::vector<int16_t> q;
#endif
  std::vector<float> step;
  std::vector<int32_t> sum_q;
  int64_t M = 0;

  int64_t at(int64_t m, int64_t w) const { return w * M + m; }  // row m's window w in step and the sums

  void resize(int64_t M, int64_t K, int64_t wsz) {
    this->M = M;
#if defined(TOKENMILL_VNNI)
    hi.resize(M * K);
    lo.resize(M * K);
#else
    q.resize(M * K);
#endif
    step.resize(M * (K / wsz));
    sum_q.resize(M * (K / wsz));
  }
};

#if defined(TOKENMILL_AVX2_PAIRS)
// AVX2's order of q: each quad (k 0-3) stored as (q0, q2, q1, q3), so that one 32-bit broadcast holds
// the two k that meet a column's even code bytes (k 0 and 2) or its odd ones (k 1 and 3); see window_sums
TM_INLINE void pair_quads(int16_t* q, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(v, 0xd8), 0xd8));
  }
  for (; i < n; i += kQuad) std::swap(q[i + 1], q[i + 2]);
}
#endif

// The largest |v[i]| of n values, 0 if there are none (NaNs are skipped, as std::max skips them), kVW
// values at a time on gemm.h's vectors (a lane keeps its maximum unless a greater value comes)
TM_INLINE float max_abs(const float* v, int64_t n) {
  vf m = {};
  int64_t i = 0;
  for (; i + kVW <= n; i += kVW) {
    vf a = loadv(v + i);
    a = a < 0.f ? -a : a;
    m = a > m ? a : m;
  }
  float amax = 0.f;
  for (int j = 0; j < kVW; ++j) amax = std::max(amax, m[j]);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  return amax;
}

#if defined(TOKENMILL_VNNI)
// q's split q = kSplit * hi + lo with hi the nearest integer to q / kSplit, halves away from zero
TM_INLINE int32_t split_hi(int32_t q) { return q >= 0 ? (q + kSplit / 2) / kSplit : -((kSplit / 2 - q) / kSplit); }
#endif

// rows [m_begin, m_end) of x [M, K] into `out` (sized by the caller for all M rows)
static void quantize_rows(int64_t K, int64_t wsz, const float* x, QuantizedRows& out, int64_t m_begin,
                          int64_t m_end) {
  const int64_t windows = K / wsz;
  for (int64_t m = m_begin; m < m_end; ++m)
    for (int64_t w = 0; w < windows; ++w) {
      const float* v = x + m * K + w * wsz;
      const int64_t at = out.at(m, w);
      const float amax = max_abs(v, wsz);
      const float step = amax > 0.f ? amax / float(kInt16Steps) : 1.f;
      int32_t sum_q = 0;
      int64_t i = 0;
#if defined(TOKENMILL_VNNI)
      int8_t* hi = out.hi.data() + m * K + w * wsz;
      int8_t* lo = out.lo.data() + m * K + w * wsz;
      {
        // the loop below, 16 values at a time: the same division, rounding and clamp (a NaN becomes
        // -kInt16Steps either way), and hi = sign(q) * ((|q| + 127) * 33027 >> 23), which is
        // sign(q) * ((|q| + 127) / 254) for every |q| <= kInt16Steps (checked exhaustively)
        static_assert(kSplit == 254 && kInt16Steps == 32258, "the multiplier below divides by 254 up to 32385");
        const __m512 by = _mm512_set1_ps(step), top = _mm512_set1_ps(float(kInt16Steps));
        const __m512 bottom = _mm512_set1_ps(-float(kInt16Steps));
        __m512i q_sums = _mm512_setzero_si512();
        for (; i + 16 <= wsz; i += 16) {
          const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(v + i), by),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m512i q = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, bottom), top));
          const __m512i half_up = _mm512_add_epi32(_mm512_abs_epi32(q), _mm512_set1_epi32(kSplit / 2));
          const __m512i size = _mm512_srli_epi32(_mm512_mullo_epi32(half_up, _mm512_set1_epi32(33027)), 23);
          const __m512i zero = _mm512_setzero_si512();
          const __m512i h = _mm512_mask_sub_epi32(size, _mm512_cmplt_epi32_mask(q, zero), zero, size);
          const __m512i l = _mm512_sub_epi32(q, _mm512_mullo_epi32(h, _mm512_set1_epi32(kSplit)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtepi32_epi8(h));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtepi32_epi8(l));
          q_sums = _mm512_add_epi32(q_sums, q);
        }
        sum_q = _mm512_reduce_add_epi32(q_sums);
      }
#else
      int16_t* qs = out.q.data() + m * K + w * wsz;
#endif
      for (; i < wsz; ++i) {
        // a division, as the jnp reference writes it (XLA may round a quotient to the other integer
        // there, which moves an output by one step of x times the weight: within the tests' bounds)
        const float r = std::min(float(kInt16Steps), std::max(-float(kInt16Steps), std::nearbyint(v[i] / step)));
        const int32_t q = int32_t(r);
        sum_q += q;
#if defined(TOKENMILL_VNNI)
        hi[i] = int8_t(split_hi(q));
        lo[i] = int8_t(q - kSplit * hi[i]);
#else
        qs[i] = int16_t(q);
#endif
      }
      out.step[at] = step;
      out.sum_q[at] = sum_q;
#if defined(TOKENMILL_AVX2_PAIRS)
      pair_quads(qs, wsz);
#endif
    }
}

// Weights for the integer dot products, one layer's: int8 codes in quad strips (plus 128), or 4-bit
// codes in nibble quad strips (GGUF's Q4_0 / Q4_1 blocks: value = code * scale + offset), with a
// scale (and an offset) per window of wsz rows and column ([K / wsz, N])
struct IntWeights {
  const uint8_t* data = nullptr;
  const float* scale = nullptr;
  const float* offset = nullptr;  // 4-bit codes only
  int64_t K = 0, N = 0, wsz = 0;
  bool nibbles = false;

  int64_t k_per_row() const { return nibbles ? 2 * kQuad : kQuad; }  // k per 128-byte row of a strip
  const uint8_t* strip(int64_t n) const { return data + (n / kStrip) * (K / k_per_row()) * kQuadRowBytes; }
};

// One window of a row into its float32 outputs, for the 32 columns of a strip: the window's exact
// integer sums, scaled (4-bit codes: plus the offsets times the window's sum of q).
template <bool nibbles>
TM_INLINE void scale_window(const int32_t* sums, int32_t sum_q, float step, const float* scale, const float* offset,
                            float* y) {
  for (int j = 0; j < kStrip; ++j) y[j] = lane_fma(float(sums[j]), step * scale[j], y[j]);
  if constexpr (nibbles) {
    const float q_sum = float(sum_q);
    for (int j = 0; j < kStrip; ++j) y[j] = lane_fma(q_sum, step * offset[j], y[j]);
  }
}

// Window w's integer sums of rows [0, R) of x (quantized, from `rows`' row m0) times a strip's 32 columns:
// sums[i][j] = sum over the window's k of q[m0 + i, k] * (the code of column j at k, less 128 for int8
// codes). A row of an int8 quad strip holds 4 k of each column; of a nibble one, 8: the low nibbles of
// a column's 4 bytes are k 0-3, the high ones k 4-7.
#if defined(TOKENMILL_VNNI)
template <int R, bool nibbles>
TM_INLINE void window_sums(const uint8_t* strip, const QuantizedRows& rows, int64_t m0, int64_t K, int64_t w,
                           int64_t wsz, int32_t (*sums)[kStrip]) {
  constexpr int64_t kRowK = nibbles ? 2 * kQuad : kQuad;
  const int8_t* hi = rows.hi.data() + m0 * K;
  const int8_t* lo = rows.lo.data() + m0 * K;
  __m512i acc[R][2][2];  // [row][hi, lo][16 columns]
  for (int i = 0; i < R; ++i)
    for (int part = 0; part < 2; ++part) acc[i][part][0] = acc[i][part][1] = _mm512_setzero_si512();
  for (int64_t k = w * wsz; k < (w + 1) * wsz; k += kRowK) {
    const uint8_t* row = strip + (k / kRowK) * kQuadRowBytes;
    __m512i b[nibbles ? 2 : 1][2];  // [the row's quads][16 columns]
    b[0][0] = _mm512_loadu_si512(row);
    b[0][1] = _mm512_loadu_si512(row + 64);
    if constexpr (nibbles) {
      const __m512i low = _mm512_set1_epi8(0x0f);
      for (int v = 0; v < 2; ++v) {
        b[1][v] = _mm512_and_si512(_mm512_srli_epi16(b[0][v], 4), low);
        b[0][v] = _mm512_and_si512(b[0][v], low);
      }
    }
    for (int quad = 0; quad < (nibbles ? 2 : 1); ++quad)
      for (int i = 0; i < R; ++i)
        for (int part = 0; part < 2; ++part) {
          int32_t x4;
          std::memcpy(&x4, (part == 0 ? hi : lo) + i * K + k + quad * kQuad, 4);
          const __m512i a = _mm512_set1_epi32(x4);
          acc[i][part][0] = _mm512_dpbusd_epi32(acc[i][part][0], b[quad][0], a);
          acc[i][part][1] = _mm512_dpbusd_epi32(acc[i][part][1], b[quad][1], a);
        }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) int32_t parts[2][kStrip];  // [hi, lo][column]
    for (int part = 0; part < 2; ++part) {
      _mm512_store_si512(parts[part], acc[i][part][0]);
      _mm512_store_si512(parts[part] + 16, acc[i][part][1]);
    }
    // the codes' 128: 128 * (kSplit * sum(hi) + sum(lo)) = 128 * sum(q) in the window; unsigned, as the
    // asm's lanes, because kSplit * hi's sum of codes plus 128 may wrap where the exact sum does not
    const uint32_t offset = nibbles ? 0u : 128u * uint32_t(rows.sum_q[rows.at(m0 + i, w)]);
    for (int j = 0; j < kStrip; ++j)
      sums[i][j] = int32_t(uint32_t(kSplit) * uint32_t(parts[0][j]) + uint32_t(parts[1][j]) - offset);
  }
}

// dot_strip's full tiles on VNNI, one window of them: 6 rows of x (hi and lo from `hi` and `lo` on, rows
// K apart) times a strip's 32 columns (`row`: the window's first row of it) over `rows` of the strip, the
// exact sums (kSplit * hi's + lo's; int8 codes: less 128 * the window's sum of q, wrapping as window_sums
// does) scaled into out's float32 rows (128 bytes apart) as scale_window does (4-bit codes: plus the
// offsets times the window's sum of q). `sums`: the six rows' steps and window sums of q (from row 0's on),
// the columns' scales and offsets. One asm loop: 24 sums (zmm0-23), a row of the strip (zmm24-25; 4-bit
// codes: its low and high nibbles, zmm24-27) and a broadcast quad of x. (As intrinsics, GCC copied the sums
// from register to register and to the stack on every pass: 65% of W1's time with `w8a16_int`, slower
// than the float32 path on an AMD Zen 5.)
struct WindowSums {
  const float* step;
  const float* scale;
  const int32_t* sum_q;
  const float* offset;  // 4-bit codes
};

template <bool nibbles>
TM_INLINE void window_6x32(const uint8_t* row, const int8_t* hi, const int8_t* lo, int64_t K, int64_t rows,
                           const WindowSums& sums, float* out) {
  static const int32_t kSplitConst = kSplit;
  static const int32_t kLowNibbles = 0x0f0f0f0f;
  const int8_t* hi3 = hi + 3 * K;
  const int8_t* lo3 = lo + 3 * K;
#define TM_QUAD(X, U, V, A, B)           \
  "vpbroadcastd " X ", %%zmm28\n\t"      \
  "vpdpbusd %%zmm28, " U ", " A "\n\t"   \
  "vpdpbusd %%zmm28, " V ", " B "\n\t"
  // one row of x: int8 codes, a quad of hi and of lo; 4-bit codes, two of each (k 0-3: the low nibbles)
#define TM_ROW(H, L, A, B, C, D) TM_QUAD(H, "%%zmm24", "%%zmm25", A, B) TM_QUAD(L, "%%zmm24", "%%zmm25", C, D)
#define TM_NIBBLE_ROW(H, H4, L, L4, A, B, C, D) \
  TM_ROW(H, L, A, B, C, D) TM_QUAD(H4, "%%zmm26", "%%zmm27", A, B) TM_QUAD(L4, "%%zmm26", "%%zmm27", C, D)
#define TM_ZERO_SUMS                                                                                     \
  "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                                    \
  "vmovdqa64 %%zmm0, %%zmm1\n\t" "vmovdqa64 %%zmm0, %%zmm2\n\t" "vmovdqa64 %%zmm0, %%zmm3\n\t"           \
  "vmovdqa64 %%zmm0, %%zmm4\n\t" "vmovdqa64 %%zmm0, %%zmm5\n\t" "vmovdqa64 %%zmm0, %%zmm6\n\t"           \
  "vmovdqa64 %%zmm0, %%zmm7\n\t" "vmovdqa64 %%zmm0, %%zmm8\n\t" "vmovdqa64 %%zmm0, %%zmm9\n\t"           \
  "vmovdqa64 %%zmm0, %%zmm10\n\t" "vmovdqa64 %%zmm0, %%zmm11\n\t" "vmovdqa64 %%zmm0, %%zmm12\n\t"        \
  "vmovdqa64 %%zmm0, %%zmm13\n\t" "vmovdqa64 %%zmm0, %%zmm14\n\t" "vmovdqa64 %%zmm0, %%zmm15\n\t"        \
  "vmovdqa64 %%zmm0, %%zmm16\n\t" "vmovdqa64 %%zmm0, %%zmm17\n\t" "vmovdqa64 %%zmm0, %%zmm18\n\t"        \
  "vmovdqa64 %%zmm0, %%zmm19\n\t" "vmovdqa64 %%zmm0, %%zmm20\n\t" "vmovdqa64 %%zmm0, %%zmm21\n\t"        \
  "vmovdqa64 %%zmm0, %%zmm22\n\t" "vmovdqa64 %%zmm0, %%zmm23\n\t"
  // row I's sums (zmm A, B: hi's; C, D: lo's) into out's row at byte Y, Y2; %[h]: sums of q, %[h3]: steps,
  // %[l3]: scales, %[l]: offsets (4-bit codes)
#define TM_COMBINE(A, B, C, D)                         \
  "vpmulld %%zmm28, " A ", " A "\n\t"                  \
  "vpmulld %%zmm28, " B ", " B "\n\t"                  \
  "vpaddd " C ", " A ", " A "\n\t"                     \
  "vpaddd " D ", " B ", " B "\n\t"
#define TM_INT8_OFFSETS(I, A, B)                       \
  "vpbroadcastd " I "(%[h]), %%zmm26\n\t"              \
  "vpslld $7, %%zmm26, %%zmm26\n\t"                    \
  "vpsubd %%zmm26, " A ", " A "\n\t"                   \
  "vpsubd %%zmm26, " B ", " B "\n\t"
#define TM_TO_FLOAT(A, B)                              \
  "vcvtdq2ps " A ", " A "\n\t"                         \
  "vcvtdq2ps " B ", " B "\n\t"
#define TM_SCALE(I, Y, Y2, A, B)                       \
  "vbroadcastss " I "(%[h3]), %%zmm26\n\t"             \
  "vmulps (%[l3]), %%zmm26, %%zmm27\n\t"               \
  "vfmadd213ps " Y "(%[out]), %%zmm27, " A "\n\t"      \
  "vmovups " A ", " Y "(%[out])\n\t"                   \
  "vmulps 64(%[l3]), %%zmm26, %%zmm27\n\t"             \
  "vfmadd213ps " Y2 "(%[out]), %%zmm27, " B "\n\t"     \
  "vmovups " B ", " Y2 "(%[out])\n\t"
#define TM_NIBBLE_SCALE(I, Y, Y2, A, B)                \
  "vbroadcastss " I "(%[h3]), %%zmm26\n\t"             \
  "vpbroadcastd " I "(%[h]), %%zmm29\n\t"              \
  "vcvtdq2ps %%zmm29, %%zmm29\n\t"                     \
  "vmulps (%[l3]), %%zmm26, %%zmm27\n\t"               \
  "vfmadd213ps " Y "(%[out]), %%zmm27, " A "\n\t"      \
  "vmulps (%[l]), %%zmm26, %%zmm27\n\t"                \
  "vfmadd231ps %%zmm29, %%zmm27, " A "\n\t"            \
  "vmovups " A ", " Y "(%[out])\n\t"                   \
  "vmulps 64(%[l3]), %%zmm26, %%zmm27\n\t"             \
  "vfmadd213ps " Y2 "(%[out]), %%zmm27, " B "\n\t"     \
  "vmulps 64(%[l]), %%zmm26, %%zmm27\n\t"              \
  "vfmadd231ps %%zmm29, %%zmm27, " B "\n\t"            \
  "vmovups " B ", " Y2 "(%[out])\n\t"
#define TM_INT8_OUT(I, Y, Y2, A, B, C, D) \
  TM_COMBINE(A, B, C, D) TM_INT8_OFFSETS(I, A, B) TM_TO_FLOAT(A, B) TM_SCALE(I, Y, Y2, A, B)
#define TM_NIBBLE_OUT(I, Y, Y2, A, B, C, D) TM_COMBINE(A, B, C, D) TM_TO_FLOAT(A, B) TM_NIBBLE_SCALE(I, Y, Y2, A, B)
  // the six rows: row i's window sums and step at byte 4i, its outputs at 128i, its sums in zmm 4i to 4i + 3
#define TM_EVERY_ROW(OUT)                                                      \
  OUT("0", "0", "64", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")                   \
  OUT("4", "128", "192", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")                \
  OUT("8", "256", "320", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11")              \
  OUT("12", "384", "448", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")           \
  OUT("16", "512", "576", "%%zmm16", "%%zmm17", "%%zmm18", "%%zmm19")           \
  OUT("20", "640", "704", "%%zmm20", "%%zmm21", "%%zmm22", "%%zmm23")
#define TM_OPERANDS                                                                                             \
  : [h] "+r"(hi), [l] "+r"(lo), [h3] "+r"(hi3), [l3] "+r"(lo3), [row] "+r"(row), [n] "+r"(rows)                \
  : [ld] "r"(K), [sums] "r"(&sums), [out] "r"(out), [split] "m"(kSplitConst), [low] "m"(kLowNibbles)          \
  : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",    \
    "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", \
    "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29"
  if constexpr (!nibbles) {
    asm volatile(
        TM_ZERO_SUMS
        "1:\n\t"
        "vmovdqu64 (%[row]), %%zmm24\n\t"
        "vmovdqu64 64(%[row]), %%zmm25\n\t"
        TM_ROW("(%[h])", "(%[l])", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")
        TM_ROW("(%[h], %[ld])", "(%[l], %[ld])", "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")
        TM_ROW("(%[h], %[ld], 2)", "(%[l], %[ld], 2)", "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11")
        TM_ROW("(%[h3])", "(%[l3])", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
        TM_ROW("(%[h3], %[ld])", "(%[l3], %[ld])", "%%zmm16", "%%zmm17", "%%zmm18", "%%zmm19")
        TM_ROW("(%[h3], %[ld], 2)", "(%[l3], %[ld], 2)", "%%zmm20", "%%zmm21", "%%zmm22", "%%zmm23")
        "add $4, %[h]\n\t"
        "add $4, %[l]\n\t"
        "add $4, %[h3]\n\t"
        "add $4, %[l3]\n\t"
        "add $128, %[row]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        // the loop's pointers are free now: the window's sums of q, steps and scales
        "mov 16(%[sums]), %[h]\n\t"
        "mov 0(%[sums]), %[h3]\n\t"
        "mov 8(%[sums]), %[l3]\n\t"
        "vpbroadcastd %[split], %%zmm28\n\t"
        TM_EVERY_ROW(TM_INT8_OUT)
        TM_OPERANDS);
  } else {
    asm volatile(
        TM_ZERO_SUMS
        "vpbroadcastd %[low], %%zmm29\n\t"
        "1:\n\t"
        "vmovdqu64 (%[row]), %%zmm24\n\t"
        "vmovdqu64 64(%[row]), %%zmm25\n\t"
        "vpsrlw $4, %%zmm24, %%zmm26\n\t"
        "vpsrlw $4, %%zmm25, %%zmm27\n\t"
        "vpandd %%zmm29, %%zmm24, %%zmm24\n\t"
        "vpandd %%zmm29, %%zmm25, %%zmm25\n\t"
        "vpandd %%zmm29, %%zmm26, %%zmm26\n\t"
        "vpandd %%zmm29, %%zmm27, %%zmm27\n\t"
        TM_NIBBLE_ROW("(%[h])", "4(%[h])", "(%[l])", "4(%[l])", "%%zmm0", "%%zmm1", "%%zmm2", "%%zmm3")
        TM_NIBBLE_ROW("(%[h], %[ld])", "4(%[h], %[ld])", "(%[l], %[ld])", "4(%[l], %[ld])",
                      "%%zmm4", "%%zmm5", "%%zmm6", "%%zmm7")
        TM_NIBBLE_ROW("(%[h], %[ld], 2)", "4(%[h], %[ld], 2)", "(%[l], %[ld], 2)", "4(%[l], %[ld], 2)",
                      "%%zmm8", "%%zmm9", "%%zmm10", "%%zmm11")
        TM_NIBBLE_ROW("(%[h3])", "4(%[h3])", "(%[l3])", "4(%[l3])", "%%zmm12", "%%zmm13", "%%zmm14", "%%zmm15")
        TM_NIBBLE_ROW("(%[h3], %[ld])", "4(%[h3], %[ld])", "(%[l3], %[ld])", "4(%[l3], %[ld])",
                      "%%zmm16", "%%zmm17", "%%zmm18", "%%zmm19")
        TM_NIBBLE_ROW("(%[h3], %[ld], 2)", "4(%[h3], %[ld], 2)", "(%[l3], %[ld], 2)", "4(%[l3], %[ld], 2)",
                      "%%zmm20", "%%zmm21", "%%zmm22", "%%zmm23")
        "add $8, %[h]\n\t"
        "add $8, %[l]\n\t"
        "add $8, %[h3]\n\t"
        "add $8, %[l3]\n\t"
        "add $128, %[row]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        // the loop's pointers are free now: the window's sums of q, offsets, steps and scales
        "mov 16(%[sums]), %[h]\n\t"
        "mov 24(%[sums]), %[l]\n\t"
        "mov 0(%[sums]), %[h3]\n\t"
        "mov 8(%[sums]), %[l3]\n\t"
        "vpbroadcastd %[split], %%zmm28\n\t"
        TM_EVERY_ROW(TM_NIBBLE_OUT)
        TM_OPERANDS);
  }
#undef TM_QUAD
#undef TM_ROW
#undef TM_NIBBLE_ROW
#undef TM_ZERO_SUMS
#undef TM_COMBINE
#undef TM_INT8_OFFSETS
#undef TM_TO_FLOAT
#undef TM_SCALE
#undef TM_NIBBLE_SCALE
#undef TM_INT8_OUT
#undef TM_NIBBLE_OUT
#undef TM_EVERY_ROW
#undef TM_OPERANDS
}
#elif defined(TOKENMILL_AVX2_PAIRS)
// AVX2: 32 bytes of a strip's row (8 columns' 4 bytes) split into 16-bit lanes, column c's two in lanes
// 2c and 2c + 1, in the order of x's q (pair_quads): int8 codes' even bytes (an AND: k 0 and 2), then
// the odd ones (a shift: k 1 and 3); 4-bit codes the same of their low nibbles (k 0-3), then of the high
// ones (k 4-7). VPMADDWD by a broadcast pair of q then adds a column's two products into its own int32
// lane: the lanes are whole columns, 8 a vector.
template <bool nibbles>
TM_INLINE void split_codes(__m256i raw, __m256i (&codes)[nibbles ? 4 : 2]) {
  if constexpr (nibbles) {
    const __m256i low = _mm256_set1_epi16(0x0f);
    codes[0] = _mm256_and_si256(raw, low);
    codes[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 8), low);
    codes[2] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    codes[3] = _mm256_srli_epi16(raw, 12);
  } else {
    codes[0] = _mm256_and_si256(raw, _mm256_set1_epi16(0xff));
    codes[1] = _mm256_srli_epi16(raw, 8);
  }
}

// G groups of 8 columns (a strip's 32 in 4) per pass over the window: R rows' sums then take R * G of
// AVX2's 16 registers
template <int R>
constexpr int kPassGroups = R == 1 ? 4 : R <= 4 ? 2 : 1;

template <int R, bool nibbles>
TM_INLINE void window_sums(const uint8_t* strip, const QuantizedRows& rows, int64_t m0, int64_t K, int64_t w,
                           int64_t wsz, int32_t (*sums)[kStrip]) {
  constexpr int G = kPassGroups<R>;
  constexpr int kPairs = nibbles ? 4 : 2;  // pairs of k a row of the strip holds
  constexpr int64_t kRowK = 2 * kPairs;
  const int16_t* q = rows.q.data() + m0 * K;
  for (int g0 = 0; g0 < kStrip / 8; g0 += G) {
    __m256i acc[R][G];
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < G; ++g) acc[i][g] = _mm256_setzero_si256();
    for (int64_t k = w * wsz; k < (w + 1) * wsz; k += kRowK) {
      const uint8_t* row = strip + (k / kRowK) * kQuadRowBytes + g0 * 8 * kQuad;
      for (int g = 0; g < G; ++g) {
        __m256i codes[kPairs];
        split_codes<nibbles>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 8 * kQuad)), codes);
        for (int i = 0; i < R; ++i)
          for (int p = 0; p < kPairs; ++p) {
            int32_t pair;
            std::memcpy(&pair, q + i * K + k + 2 * p, 4);
            acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(codes[p], _mm256_set1_epi32(pair)));
          }
      }
    }
    // The int32 lanes may wrap where an int8 window is long (its codes carry 128 each): the sum less
    // 128 * sum(q) fits, and wraps back.
    for (int i = 0; i < R; ++i) {
      const __m256i offset = _mm256_set1_epi32(nibbles ? 0 : 128 * rows.sum_q[rows.at(m0 + i, w)]);
      for (int g = 0; g < G; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i] + (g0 + g) * 8), _mm256_sub_epi32(acc[i][g], offset));
    }
  }
}

// dot_strip's full int8 tiles, one window of them: 5 rows of x (q from `q` on, rows K apart; their
// steps and sums of q from `step` and `sum_q` on) times 16 columns of a quad strip (`row`: their bytes in
// the window's first row of it; their scales from `scale` on) over `quads` rows of the strip, the exact
// sums (less 128 * sum(q)) scaled into out's float32 rows (128 bytes apart) as scale_window does. One
// asm loop: 10 sums (ymm4-11, 14, 15), the even and odd codes of 16 columns, a pair of q and a product
// fill AVX2's 16 registers. (As intrinsics, the compiler broadcast every row's q before it multiplied,
// and spilled sums to the stack, where each add then waited on a store and a load.) Its loop alone, on
// a Zen 3: 4.75 G VPMADDWD a second, against 4.37 for 6 rows x 8 columns, where each broadcast pair of q
// serves one multiply instead of two.
TM_INLINE void window_5x16(const uint8_t* row, const int16_t* q, int64_t K, int64_t quads, const int32_t* sum_q,
                           const float* step, const float* scale, float* out) {
  static const __m256i kLowBytes = {0x00ff00ff00ff00ffLL, 0x00ff00ff00ff00ffLL, 0x00ff00ff00ff00ffLL, 0x00ff00ff00ff00ffLL};
  const int16_t* q3 = q + 3 * K;
  const int64_t ld = K * int64_t(sizeof(int16_t));
#define TM_ROW(X, X2, S, T)                \
  "vpbroadcastd " X ", %%ymm2\n\t"         \
  "vpmaddwd %%ymm0, %%ymm2, %%ymm3\n\t"    \
  "vpaddd %%ymm3, " S ", " S "\n\t"        \
  "vpmaddwd %%ymm12, %%ymm2, %%ymm3\n\t"   \
  "vpaddd %%ymm3, " T ", " T "\n\t"        \
  "vpbroadcastd " X2 ", %%ymm2\n\t"        \
  "vpmaddwd %%ymm1, %%ymm2, %%ymm3\n\t"    \
  "vpaddd %%ymm3, " S ", " S "\n\t"        \
  "vpmaddwd %%ymm13, %%ymm2, %%ymm3\n\t"   \
  "vpaddd %%ymm3, " T ", " T "\n\t"
#define TM_SCALE(I, Y, Y2, S, T)                 \
  "vpbroadcastd " I "(%[sq]), %%ymm2\n\t"        \
  "vpslld $7, %%ymm2, %%ymm2\n\t"                \
  "vpsubd %%ymm2, " S ", " S "\n\t"              \
  "vpsubd %%ymm2, " T ", " T "\n\t"              \
  "vcvtdq2ps " S ", " S "\n\t"                   \
  "vcvtdq2ps " T ", " T "\n\t"                   \
  "vbroadcastss " I "(%[st]), %%ymm2\n\t"        \
  "vmulps (%[sc]), %%ymm2, %%ymm3\n\t"           \
  "vfmadd213ps " Y "(%[out]), %%ymm3, " S "\n\t" \
  "vmovups " S ", " Y "(%[out])\n\t"             \
  "vmulps 32(%[sc]), %%ymm2, %%ymm3\n\t"         \
  "vfmadd213ps " Y2 "(%[out]), %%ymm3, " T "\n\t" \
  "vmovups " T ", " Y2 "(%[out])\n\t"
  asm volatile(
      "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
      "vmovdqa %%ymm4, %%ymm5\n\t" "vmovdqa %%ymm4, %%ymm6\n\t" "vmovdqa %%ymm4, %%ymm7\n\t"
      "vmovdqa %%ymm4, %%ymm8\n\t" "vmovdqa %%ymm4, %%ymm9\n\t" "vmovdqa %%ymm4, %%ymm10\n\t"
      "vmovdqa %%ymm4, %%ymm11\n\t" "vmovdqa %%ymm4, %%ymm14\n\t" "vmovdqa %%ymm4, %%ymm15\n\t"
      "1:\n\t"
      "vmovdqu (%[row]), %%ymm0\n\t"
      "vmovdqu 32(%[row]), %%ymm12\n\t"
      "vpsrlw $8, %%ymm0, %%ymm1\n\t"
      "vpand %[low], %%ymm0, %%ymm0\n\t"
      "vpsrlw $8, %%ymm12, %%ymm13\n\t"
      "vpand %[low], %%ymm12, %%ymm12\n\t"
      TM_ROW("(%[q0])", "4(%[q0])", "%%ymm4", "%%ymm5")
      TM_ROW("(%[q0], %[ld])", "4(%[q0], %[ld])", "%%ymm6", "%%ymm7")
      TM_ROW("(%[q0], %[ld], 2)", "4(%[q0], %[ld], 2)", "%%ymm8", "%%ymm9")
      TM_ROW("(%[q3])", "4(%[q3])", "%%ymm10", "%%ymm11")
      TM_ROW("(%[q3], %[ld])", "4(%[q3], %[ld])", "%%ymm14", "%%ymm15")
      "add $8, %[q0]\n\t"
      "add $8, %[q3]\n\t"
      "add $128, %[row]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      TM_SCALE("0", "0", "32", "%%ymm4", "%%ymm5")
      TM_SCALE("4", "128", "160", "%%ymm6", "%%ymm7")
      TM_SCALE("8", "256", "288", "%%ymm8", "%%ymm9")
      TM_SCALE("12", "384", "416", "%%ymm10", "%%ymm11")
      TM_SCALE("16", "512", "544", "%%ymm14", "%%ymm15")
      : [q0] "+r"(q), [q3] "+r"(q3), [row] "+r"(row), [n] "+r"(quads)
      : [ld] "r"(ld), [sq] "r"(sum_q), [st] "r"(step), [sc] "r"(scale), [out] "r"(out), [low] "m"(kLowBytes)
      : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef TM_ROW
#undef TM_SCALE
}
#else
template <int R, bool nibbles>
TM_INLINE void window_sums(const uint8_t* strip, const QuantizedRows& rows, int64_t m0, int64_t K, int64_t w,
                           int64_t wsz, int32_t (*sums)[kStrip]) {
  constexpr int64_t kRowK = nibbles ? 2 * kQuad : kQuad;
  const int16_t* q = rows.q.data() + m0 * K;
  for (int i = 0; i < R; ++i) std::fill(sums[i], sums[i] + kStrip, 0);
  for (int64_t k = w * wsz; k < (w + 1) * wsz; k += kRowK) {
    const uint8_t* row = strip + (k / kRowK) * kQuadRowBytes;
    for (int i = 0; i < R; ++i) {
      const int16_t* a = q + i * K + k;
      for (int j = 0; j < kStrip; ++j) {
        const uint8_t* c = row + j * kQuad;
        int32_t sum = 0;
        for (int t = 0; t < kQuad; ++t) {
          if constexpr (nibbles)
            sum += int32_t(c[t] & 0x0f) * a[t] + int32_t(c[t] >> 4) * a[kQuad + t];
          else
            sum += (int32_t(c[t]) - 128) * a[t];
        }
        sums[i][j] += sum;
      }
    }
  }
}
#endif

// Rows [0, R) of x (quantized, from `rows`' row m0) times the strip of columns [n, n + 32), all K,
// into out: windows in order, each summed in integers and then scaled.
// (A decode step of up to kGemvRows rows streams each strip from memory once, and is not prefetched in
// software: the hardware's prefetchers follow the strips, and each line's PREFETCHT0 ahead cost SmolLM2's
// decoding about 8%.) `fetch_next` (the first tile of a block of more rows, dot_gemm): the next strip's
// rows of each window are fetched into L2 as this one's are summed, so that the block's tiles over it find
// it there. Without this, 24% of `dot_strip<6>`'s samples in W1 `w8a16_int` waited on a strip row's first
// load (AMD Zen 5: 30 layers of projections at 64 rows, 3 alternating pairs, 212-221 -> 254-290 GMAC/s;
// W1's decode steps 70-79 -> 63-65 ms).
template <int R, bool nibbles>
static void dot_strip(const IntWeights& B, const QuantizedRows& rows, int64_t m0, int64_t n, float (*out)[kStrip],
                      bool fetch_next) {
  const int64_t K = B.K, wsz = B.wsz, windows = K / wsz;
  const uint8_t* strip = B.strip(n);
  const int64_t window_rows = wsz / B.k_per_row(), window_bytes = window_rows * kQuadRowBytes;  // of a strip
  const uint8_t* next = fetch_next && n + kStrip < B.N ? B.strip(n + kStrip) : nullptr;
  std::fill(out[0], out[0] + R * kStrip, 0.f);
  for (int64_t w = 0; w < windows; ++w) {
    if (next != nullptr)
      for (int64_t b = 0; b < window_bytes; b += 64) __builtin_prefetch(next + w * window_bytes + b, 0, 2);
#if defined(TOKENMILL_VNNI)
    if constexpr (R == kDotTileRows) {  // full tiles: summed and scaled in one asm
      const int64_t at = rows.at(m0, w);
      const WindowSums window{rows.step.data() + at, B.scale + w * B.N + n, rows.sum_q.data() + at,
                              nibbles ? B.offset + w * B.N + n : nullptr};
      window_6x32<nibbles>(strip + w * window_bytes, rows.hi.data() + m0 * K + w * wsz,
                           rows.lo.data() + m0 * K + w * wsz, K, window_rows, window, out[0]);
      continue;
    }
#elif defined(TOKENMILL_AVX2_PAIRS)
    if constexpr (R == kDotTileRows && !nibbles) {  // full int8 tiles: summed and scaled in one asm
      for (int g = 0; g < kStrip / 16; ++g)
        window_5x16(strip + w * window_bytes + g * 16 * kQuad, rows.q.data() + m0 * K + w * wsz, K,
                    window_rows, rows.sum_q.data() + rows.at(m0, w), rows.step.data() + rows.at(m0, w),
                    B.scale + w * B.N + n + g * 16, out[0] + g * 16);
      continue;
    }
#endif
    alignas(64) int32_t sums[R][kStrip];
    window_sums<R, nibbles>(strip, rows, m0, K, w, wsz, sums);
    const float* window_scale = B.scale + w * B.N + n;
    const float* window_offset = nibbles ? B.offset + w * B.N + n : nullptr;
    for (int i = 0; i < R; ++i) {
      const int64_t at = rows.at(m0 + i, w);
      scale_window<nibbles>(sums[i], rows.sum_q[at], rows.step[at], window_scale, window_offset, out[i]);
    }
  }
}

// Rows [m, m + R) of y over the strips of columns [n0, n1). `gated` (B a fused gate/up projection,
// y [M, N / 2]): column n of y is silu(x . gate column n) * (x . up column N / 2 + n), activated while
// both strips' tiles are in L1 (silu.h), so that the [M, N] product never goes to memory.
template <int R>
static void dot_tiles(const IntWeights& B, const QuantizedRows& rows, float* y, int64_t m, int64_t n0, int64_t n1,
                      bool gated, bool fetch_next) {
  const auto strip = B.nibbles ? &dot_strip<R, true> : &dot_strip<R, false>;
  const int64_t ld = gated ? B.N / 2 : B.N;
  for (int64_t n = n0; n < n1; n += kStrip) {
    float out[2][R][kStrip];  // [gate or all, up][row][column]
    strip(B, rows, m, n, out[0], fetch_next);
    if (gated) {
      strip(B, rows, m, ld + n, out[1], fetch_next);
      silu_gate(out[0][0], kStrip, R * kStrip, R, kStrip, y + m * ld + n, ld);
    } else {
      for (int i = 0; i < R; ++i) std::memcpy(y + (m + i) * ld + n, out[0][i], sizeof(out[0][i]));
    }
  }
}

template <int... Rs>
constexpr auto dot_tile_table(std::integer_sequence<int, Rs...>) {
  using Tiles = void (*)(const IntWeights&, const QuantizedRows&, float*, int64_t, int64_t, int64_t, bool, bool);
  return std::array<Tiles, sizeof...(Rs)>{&dot_tiles<Rs + 1>...};
}
constexpr auto kDotTiles = dot_tile_table(std::make_integer_sequence<int, kDotTileRows>{});  // [r - 1]: r rows

// Columns [n0, n1) (whole strips) of y = x . B (`gated`: of y = silu(x . gate) * (x . up), dot_tiles):
// up to kGemvRows rows (decoding) in one pass over the strips, each streamed from memory once; more in
// tiles of up to kDotTileRows rows over each strip, kDotMC rows of x at a time so that they stay in L2
// while the block's strips pass.
static void dot_gemm(int64_t M, const IntWeights& B, const QuantizedRows& rows, float* y, int64_t n0, int64_t n1,
                     bool gated) {
  constexpr int64_t kDotMC = 8 * kDotTileRows;  // whole tiles (gemm.h's kMC: 8 of its own)
  if (M <= kGemvRows) return kDotTiles[M - 1](B, rows, y, 0, n0, n1, gated, false);
  for (int64_t mc = 0; mc < M; mc += kDotMC)
    for (int64_t n = n0; n < n1; n += kStrip)
      for (int64_t m = mc; m < std::min(M, mc + kDotMC); m += kDotTileRows) {
        const int64_t r = std::min<int64_t>(kDotTileRows, M - m);
        kDotTiles[r - 1](B, rows, y, m, n, n + kStrip, gated, m == mc);
      }
}

}  // namespace
