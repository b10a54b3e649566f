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
// instruction), so there q multiplies the codes widened to 16 bits, with no split.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TOKENMILL_VNNI 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQuad = 4;  // k per group of bytes a VPDPBUSD lane sums
constexpr int64_t kQuadRowBytes = kStrip * kQuad;  // one row of a quad strip: 128 bytes
constexpr int kDotTileRows = 6;  // rows per tile of the GEMM (VNNI: 24 of the 32 vector registers hold sums)
constexpr int32_t kSplit = 254;  // q = kSplit * hi + lo
constexpr int32_t kInt16Steps = 127 * kSplit;  // the largest |q|
constexpr int64_t kMaxIntWindow = 512;  // wsz * kInt16Steps * 127 < 2^31

// x's rows quantized per window: q [M, K] (on VNNI builds split into hi and lo instead), with each
// window's step and sum of q ([M, K / wsz]; VNNI: the sums of hi and of lo as well)
struct QuantizedRows {
#if defined(TOKENMILL_VNNI)
  std::vector<int8_t> hi, lo;
  std::vector<int32_t> sum_hi, sum_lo;
#else
  std::vector<int16_t> q;
#endif
  std::vector<float> step;
  std::vector<int32_t> sum_q;

  void resize(int64_t M, int64_t K, int64_t wsz) {
#if defined(TOKENMILL_VNNI)
    hi.resize(M * K);
    lo.resize(M * K);
    sum_hi.resize(M * (K / wsz));
    sum_lo.resize(M * (K / wsz));
#else
    q.resize(M * K);
#endif
    step.resize(M * (K / wsz));
    sum_q.resize(M * (K / wsz));
  }
};

// rows [m_begin, m_end) of x [M, K] into `out` (sized by the caller for all M rows)
static void quantize_rows(int64_t K, int64_t wsz, const float* x, QuantizedRows& out, int64_t m_begin,
                          int64_t m_end) {
  const int64_t windows = K / wsz;
  for (int64_t m = m_begin; m < m_end; ++m)
    for (int64_t w = 0; w < windows; ++w) {
      const float* v = x + m * K + w * wsz;
      const int64_t at = m * windows + w;
      float amax = 0.f;
      for (int64_t i = 0; i < wsz; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float step = amax > 0.f ? amax / float(kInt16Steps) : 1.f;
      int32_t sum_q = 0;
#if defined(TOKENMILL_VNNI)
      int8_t* hi = out.hi.data() + m * K + w * wsz;
      int8_t* lo = out.lo.data() + m * K + w * wsz;
      int32_t sum_hi = 0, sum_lo = 0;
#else
      int16_t* qs = out.q.data() + m * K + w * wsz;
#endif
      for (int64_t i = 0; i < wsz; ++i) {
        // a division, as the jnp reference writes it (XLA may round a quotient to the other integer
        // there, which moves an output by one step of x times the weight: within the tests' bounds)
        const float r = std::min(float(kInt16Steps), std::max(-float(kInt16Steps), std::nearbyint(v[i] / step)));
        const int32_t q = int32_t(r);
        sum_q += q;
#if defined(TOKENMILL_VNNI)
        const int32_t h = q >= 0 ? (q + kSplit / 2) / kSplit : -((kSplit / 2 - q) / kSplit);  // nearest
        hi[i] = int8_t(h);
        lo[i] = int8_t(q - kSplit * h);
        sum_hi += hi[i];
        sum_lo += lo[i];
#else
        qs[i] = int16_t(q);
#endif
      }
      out.step[at] = step;
      out.sum_q[at] = sum_q;
#if defined(TOKENMILL_VNNI)
      out.sum_hi[at] = sum_hi;
      out.sum_lo[at] = sum_lo;
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
  const int64_t windows = K / wsz;
  for (int i = 0; i < R; ++i) {
    alignas(64) int32_t parts[2][kStrip];  // [hi, lo][column]
    for (int part = 0; part < 2; ++part) {
      _mm512_store_si512(parts[part], acc[i][part][0]);
      _mm512_store_si512(parts[part] + 16, acc[i][part][1]);
    }
    // the codes' 128: 128 * sum(hi) and 128 * sum(lo) in the window
    const int64_t at = (m0 + i) * windows + w;
    const int32_t hi_offset = nibbles ? 0 : 128 * rows.sum_hi[at], lo_offset = nibbles ? 0 : 128 * rows.sum_lo[at];
    for (int j = 0; j < kStrip; ++j) sums[i][j] = kSplit * (parts[0][j] - hi_offset) + (parts[1][j] - lo_offset);
  }
}
#elif defined(__AVX2__)
// G vectors of 4 columns (a strip's 32 in 8) per pass over the window: R rows' sums then take R * G of
// AVX2's 16 registers
template <int R>
constexpr int kPassVectors = R == 1 ? 8 : R <= 3 ? 4 : 2;

// s[i][v] = the products of 6 rows of q (from q on, rows K apart) and 8 columns' codes (v: two vectors of
// 4 columns, G = 2) over `quads` (at least one) rows of a quad strip from `row` on, in int32 lanes as
// window_sums keeps them. One asm loop: as intrinsics, the compiler broadcast all 6 rows' q and multiplied before
// it added, and spilled half the sums to the stack, where each add then waited on a store and a load;
// here 12 sums (ymm4-15), 2 codes, a q and a product fill AVX2's 16 registers (SmolLM2's W1 with
// w8a16_int on a Zen 3, 2 alternating pairs: 178 and 195 -> 238 and 238 output tok/s).
TM_INLINE void sums_6x8(const uint8_t* row, const int16_t* q, int64_t K, int64_t quads, __m256i (&s)[6][2]) {
  const int16_t* q3 = q + 3 * K;
  const int64_t ld = K * int64_t(sizeof(int16_t));
#define TM_ROW(X, S0, S1)              \
  "vpbroadcastq " X ", %%ymm2\n\t"     \
  "vpmaddwd %%ymm0, %%ymm2, %%ymm3\n\t" \
  "vpaddd %%ymm3, " S0 ", " S0 "\n\t"  \
  "vpmaddwd %%ymm1, %%ymm2, %%ymm3\n\t" \
  "vpaddd %%ymm3, " S1 ", " S1 "\n\t"
  asm volatile(
      "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
      "vmovdqa %%ymm4, %%ymm5\n\t" "vmovdqa %%ymm4, %%ymm6\n\t" "vmovdqa %%ymm4, %%ymm7\n\t"
      "vmovdqa %%ymm4, %%ymm8\n\t" "vmovdqa %%ymm4, %%ymm9\n\t" "vmovdqa %%ymm4, %%ymm10\n\t"
      "vmovdqa %%ymm4, %%ymm11\n\t" "vmovdqa %%ymm4, %%ymm12\n\t" "vmovdqa %%ymm4, %%ymm13\n\t"
      "vmovdqa %%ymm4, %%ymm14\n\t" "vmovdqa %%ymm4, %%ymm15\n\t"
      "1:\n\t"
      "vpmovzxbw (%[row]), %%ymm0\n\t"
      "vpmovzxbw 16(%[row]), %%ymm1\n\t"
      TM_ROW("(%[q0])", "%%ymm4", "%%ymm5")
      TM_ROW("(%[q0], %[ld])", "%%ymm6", "%%ymm7")
      TM_ROW("(%[q0], %[ld], 2)", "%%ymm8", "%%ymm9")
      TM_ROW("(%[q3])", "%%ymm10", "%%ymm11")
      TM_ROW("(%[q3], %[ld])", "%%ymm12", "%%ymm13")
      TM_ROW("(%[q3], %[ld], 2)", "%%ymm14", "%%ymm15")
      "add $8, %[q0]\n\t"
      "add $8, %[q3]\n\t"
      "add $128, %[row]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vmovdqu %%ymm4, (%[s])\n\t" "vmovdqu %%ymm5, 32(%[s])\n\t" "vmovdqu %%ymm6, 64(%[s])\n\t"
      "vmovdqu %%ymm7, 96(%[s])\n\t" "vmovdqu %%ymm8, 128(%[s])\n\t" "vmovdqu %%ymm9, 160(%[s])\n\t"
      "vmovdqu %%ymm10, 192(%[s])\n\t" "vmovdqu %%ymm11, 224(%[s])\n\t" "vmovdqu %%ymm12, 256(%[s])\n\t"
      "vmovdqu %%ymm13, 288(%[s])\n\t" "vmovdqu %%ymm14, 320(%[s])\n\t" "vmovdqu %%ymm15, 352(%[s])"
      : [q0] "+r"(q), [q3] "+r"(q3), [row] "+r"(row), [n] "+r"(quads)
      : [ld] "r"(ld), [s] "r"(&s[0][0])
      : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef TM_ROW
}

template <int R, bool nibbles>
TM_INLINE void window_sums(const uint8_t* strip, const QuantizedRows& rows, int64_t m0, int64_t K, int64_t w,
                           int64_t wsz, int32_t (*sums)[kStrip]) {
  constexpr int G = kPassVectors<R>;
  constexpr int64_t kRowK = nibbles ? 2 * kQuad : kQuad;
  const int16_t* q = rows.q.data() + m0 * K;
  const int64_t windows = K / wsz;
  for (int g0 = 0; g0 < kStrip / 4; g0 += G) {
    __m256i acc[R][G];  // int32 lanes: (column, k 0-1), (column, k 2-3) for 4 columns
    if constexpr (R == 6 && G == 2 && !nibbles) {  // dot_gemm's full tiles (kDotTileRows rows)
      sums_6x8(strip + (w * wsz / kRowK) * kQuadRowBytes + g0 * 4 * kQuad, q + w * wsz, K, wsz / kRowK, acc);
    } else {
      for (int i = 0; i < R; ++i)
        for (int g = 0; g < G; ++g) acc[i][g] = _mm256_setzero_si256();
      for (int64_t k = w * wsz; k < (w + 1) * wsz; k += kRowK) {
        const uint8_t* row = strip + (k / kRowK) * kQuadRowBytes + g0 * 4 * kQuad;
        for (int g = 0; g < G; ++g) {
          // 4 columns' 4 bytes, widened: 16-bit lane l holds column l / 4's byte l % 4
          const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
          for (int i = 0; i < R; ++i) {
            int64_t x4;  // q at k..k+3, in every column's 4 lanes
            std::memcpy(&x4, q + i * K + k, 8);
            if constexpr (nibbles) {
              int64_t x4_high;
              std::memcpy(&x4_high, q + i * K + k + kQuad, 8);
              const __m256i low = _mm256_and_si256(codes, _mm256_set1_epi16(0x0f)), high = _mm256_srli_epi16(codes, 4);
              acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(low, _mm256_set1_epi64x(x4)));
              acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(high, _mm256_set1_epi64x(x4_high)));
            } else {
              acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(codes, _mm256_set1_epi64x(x4)));
            }
          }
        }
      }
    }
    // Adjacent lanes are one column's: added, 8 columns a vector. The int32 lanes may wrap where an
    // int8 window is long (its codes carry 128 each): the sum less 128 * sum(q) fits, and wraps back.
    for (int i = 0; i < R; ++i) {
      const __m256i offset = _mm256_set1_epi32(nibbles ? 0 : 128 * rows.sum_q[(m0 + i) * windows + w]);
      for (int g = 0; g < G; g += 2) {
        const __m256i pairs = _mm256_hadd_epi32(acc[i][g], acc[i][g + 1]);  // columns 0 1 4 5 | 2 3 6 7
        const __m256i columns = _mm256_sub_epi32(_mm256_permute4x64_epi64(pairs, 0xd8), offset);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i] + (g0 + g) * 4), columns);
      }
    }
  }
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
// into y's rows (leading dimension N): windows in order, each summed in integers and then scaled.
// (Decoding streams each strip from memory once, and is not prefetched in software: the hardware's
// prefetchers follow the strips, and each line's PREFETCHT0 ahead cost SmolLM2's decoding about 8%.)
template <int R, bool nibbles>
static void dot_strip(const IntWeights& B, const QuantizedRows& rows, int64_t m0, float* y, int64_t n) {
  const int64_t K = B.K, wsz = B.wsz, windows = K / wsz;
  const uint8_t* strip = B.strip(n);
  float out[R][kStrip] = {};
  for (int64_t w = 0; w < windows; ++w) {
    alignas(64) int32_t sums[R][kStrip];
    window_sums<R, nibbles>(strip, rows, m0, K, w, wsz, sums);
    const float* window_scale = B.scale + w * B.N + n;
    const float* window_offset = nibbles ? B.offset + w * B.N + n : nullptr;
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * windows + w;
      scale_window<nibbles>(sums[i], rows.sum_q[at], rows.step[at], window_scale, window_offset, out[i]);
    }
  }
  for (int i = 0; i < R; ++i) std::memcpy(y + i * B.N + n, out[i], sizeof(out[i]));
}

// Rows [m, m + R) of y over the strips of columns [n0, n1)
template <int R>
static void dot_tiles(const IntWeights& B, const QuantizedRows& rows, float* y, int64_t m, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kStrip) {
    if (B.nibbles)
      dot_strip<R, true>(B, rows, m, y + m * B.N, n);
    else
      dot_strip<R, false>(B, rows, m, y + m * B.N, n);
  }
}

template <int... Rs>
constexpr auto dot_tile_table(std::integer_sequence<int, Rs...>) {
  using Tiles = void (*)(const IntWeights&, const QuantizedRows&, float*, int64_t, int64_t, int64_t);
  return std::array<Tiles, sizeof...(Rs)>{&dot_tiles<Rs + 1>...};
}
constexpr auto kDotTiles = dot_tile_table(std::make_integer_sequence<int, kDotTileRows>{});  // [r - 1]: r rows

// Columns [n0, n1) (whole strips) of y = x . B: up to kGemvRows rows (decoding) in one pass over the
// strips, each streamed from memory once; more in tiles of up to kDotTileRows rows over each strip,
// kMC rows of x at a time so that they stay in L2 while the block's strips pass.
static void dot_gemm(int64_t M, const IntWeights& B, const QuantizedRows& rows, float* y, int64_t n0, int64_t n1) {
  if (M <= kGemvRows) return kDotTiles[M - 1](B, rows, y, 0, n0, n1);
  for (int64_t mc = 0; mc < M; mc += kMC)
    for (int64_t n = n0; n < n1; n += kStrip)
      for (int64_t m = mc; m < std::min(M, mc + kMC); m += kDotTileRows) {
        const int64_t r = std::min<int64_t>(kDotTileRows, M - m);
        kDotTiles[r - 1](B, rows, y, m, n, n + kStrip);
      }
}

}  // namespace
