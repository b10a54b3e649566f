// A float32 GEMM for the CPU kernels: C[M, N] = A[M, K] . B[K, N], with B float32 or 8-bit (int8,
// float8 e4m3fn / e5m2) plus one float32 scale per window of rows and column, or 4-bit codes with a
// scale and an offset per window and column (GGUF's Q4_0 / Q4_1 blocks), dequantized as it is
// packed. Included by moe_experts.cc and linear.cc (one translation unit each; build.py hashes this
// header into both libraries' names).
//
// GotoBLAS-style blocking: B is packed kKC x kNC at a time (L2-sized) into strips of kNR columns, A
// into kMR-row tiles; a register-blocked micro-kernel keeps kMR x kNR of C in registers while one
// strip of B (L1-sized) meets every row tile. The next panel of B is prefetched into L2 while the
// current one is multiplied, so streaming the weights from memory overlaps the arithmetic.
// The vector code uses GCC vector extensions: AVX-512 or AVX2/FMA as the build enables, else portable.

#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kVW = 16;  // floats per vector register
#else
constexpr int kVW = 8;
#endif
typedef float vf __attribute__((vector_size(kVW * sizeof(float))));

#define TM_INLINE static inline __attribute__((always_inline))

// Register blocking: kMR rows x kNR columns of C live in kMR * kNV vector registers.
constexpr int kNV = 2;
constexpr int kNR = kNV * kVW;
constexpr int kMR = kVW == 16 ? 12 : 6;  // 24 of AVX-512's 32 registers, 12 of AVX2's 16
// Panels are deep and narrow: up to 768 rows (SmolLM2's K = 576 in one panel) of 64 columns (at most
// 192 KiB: it, the next one streaming in and a kMC-row block of A, 221 KiB at K = 576, stay in a
// 1 MiB L2; AVX2's blocks of A are half as tall). One panel over all
// of K writes each tile of C once instead of reloading it per panel: C's rows lie N floats apart, and
// at N = 3072 (12 KiB, a multiple of 4 KiB) a tile's 12 rows fall in the same few L1 sets. On Zen 4,
// one thread, 264 x 576 x 3072: 103 -> 112 GFLOP/s (the micro-kernel alone: 113); 30 layers of
// SmolLM2's projections, two threads: 188 -> 202 GFLOP/s at 2048 rows, 179 -> 185 at 64 (256 x 256
// panels before).
constexpr int64_t kKC = 768;  // rows of B per packed panel, at most
constexpr int64_t kNC = 64;  // columns of B per packed panel
// Weights may also be stored in strips (linear.cc's layout, made at load time): strips of kStrip
// columns, each K x kStrip contiguous, so that the micro-kernel reads float32 ones in place and a
// GEMV streams each strip instead of striding across the rows of B.
constexpr int64_t kStrip = 32;
static_assert(kStrip % kNR == 0, "a stored strip holds whole micro-kernel strips");

TM_INLINE vf loadv(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

TM_INLINE void storev(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// float8 code → float32 value, for every code of e4m3fn (no infinities; S.1111.111 is NaN) and of
// e5m2 (IEEE-like)
static std::array<float, 256> float8_table(int mantissa_bits, int bias, bool ieee) {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int magnitude = code & 0x7f;
    const int exponent = magnitude >> mantissa_bits, mantissa = magnitude & ((1 << mantissa_bits) - 1);
    const int top = (1 << (7 - mantissa_bits)) - 1;
    float value;
    if (ieee && exponent == top)
      value = mantissa == 0 ? INFINITY : NAN;
    else if (!ieee && magnitude == 0x7f)
      value = NAN;
    else if (exponent == 0)
      value = std::ldexp(float(mantissa), 1 - bias - mantissa_bits);
    else
      value = std::ldexp(float(mantissa + (1 << mantissa_bits)), exponent - bias - mantissa_bits);
    table[code] = code & 0x80 ? -value : value;
  }
  return table;
}
static const std::array<float, 256> kE4M3 = float8_table(3, 7, false);
static const std::array<float, 256> kE5M2 = float8_table(2, 15, true);

// A weight matrix B[K, N], row-major or in strips: float32, or 8-bit codes (int8, or float8 decoded
// through `table`) with one float32 scale per window of `wsz` rows and column (scale [K / wsz, N],
// row-major either way), or 4-bit codes in strips with a scale and an offset per window and column:
// value = code * scale + offset.
struct Weights {
  const char* data = nullptr;
  int64_t N = 0;
  int elem = 4;  // bytes per value (1 for 4-bit codes, which are addressed through `bytes`)
  const float* table = nullptr;  // float8 only
  bool is_int8 = false;
  // 4-bit codes 0..15 (in strips only): byte j of a strip's row holds columns 2j and 2j + 1 in its
  // low and high nibble
  bool is_uint4 = false;
  const float* scale = nullptr;  // nullptr: float32 values
  const float* offset = nullptr;  // 4-bit only: [K / wsz, N], like the scales
  int64_t wsz = 0;
  // 0 for row-major B, else B is stored in strips of kStrip columns, each K x kStrip k-major, and
  // this is the number of values from one strip to the next (K * kStrip)
  int64_t strip_stride = 0;

  int64_t bytes(int64_t values) const { return is_uint4 ? values / 2 : values * elem; }

  // where B[k, n] lies (in strips, the kStrip - n % kStrip values from there on are its row's; for
  // 4-bit codes, n even)
  const char* address(int64_t k, int64_t n) const {
    const int64_t index = strip_stride == 0 ? k * N + n : (n / kStrip) * strip_stride + k * kStrip + n % kStrip;
    return data + bytes(index);
  }

  // float32 weights stored in strips: where column n's strip holds row k
  const float* strip_at(int64_t k, int64_t n) const { return reinterpret_cast<const float*>(address(k, n)); }

  // the sub-matrix that starts `values` values and `scales` scales further on (another expert's)
  Weights at(int64_t values, int64_t scales) const {
    Weights w = *this;
    w.data += bytes(values);
    if (w.scale != nullptr) w.scale += scales;
    if (w.offset != nullptr) w.offset += scales;
    return w;
  }

  // the columns from n0 on (in strips, n0 a whole strip), as a matrix of their own
  Weights columns_from(int64_t n0) const { return at(strip_stride == 0 ? n0 : n0 / kStrip * strip_stride, n0); }
};

// The cache lines of the next panel of B, fetched into L2 a few at a time while the current panel
// is multiplied, so that streaming the weights from memory overlaps the arithmetic.
struct Prefetch {
  const char* row = nullptr;  // the current row's first byte
  int64_t stride = 0;  // bytes between rows
  int64_t row_lines = 0;  // cache lines per row
  int64_t rows_left = 0;
  int64_t line = 0;  // the next line within the row

  Prefetch() = default;
  // rows [k0, k0 + rows) x columns [n0, n0 + cols) of B (its scales are few: left to the hardware);
  // of B in strips, the rows of each strip in turn (n0 and cols whole strips)
  Prefetch(const Weights& B, int64_t k0, int64_t n0, int64_t rows, int64_t cols) {
    if (B.strip_stride == 0) {
      row = B.data + (k0 * B.N + n0) * B.elem;
      stride = B.N * B.elem;
      row_lines = (cols * B.elem + 63) / 64;
      rows_left = rows;
    } else {
      row = B.address(k0, n0);
      stride = B.bytes(B.strip_stride);
      row_lines = (B.bytes(rows * kStrip) + 63) / 64;
      rows_left = (cols + kStrip - 1) / kStrip;
    }
  }

  inline __attribute__((always_inline)) void step() {
    if (rows_left <= 0) return;
    __builtin_prefetch(row + line * 64, 0, 2);
    if (++line == row_lines) {
      line = 0;
      row += stride;
      --rows_left;
    }
  }
};

TM_INLINE vf splat(float x) { return x - vf{}; }  // (x + 0 is not x for x = -0: it would cost an add)

// a * b + c rounded as the vector lanes' `c += a * b` is: one fused rounding where the target has
// FMA (-ffp-contract=fast fuses the lanes; a scalar expression it may leave unfused, so std::fma),
// else two roundings.
TM_INLINE float lane_fma(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  const float product = a * b;
  return product + c;
#endif
}

// rows [0, rows) of a kNR-column tile of C (leading dimension ldc) towards the cache, for writing
TM_INLINE void prefetch_tile(const float* C, int64_t ldc, int rows) {
  for (int i = 0; i < rows; ++i)
    for (int line = 0; line < kNR * int(sizeof(float)); line += 64) __builtin_prefetch(C + i * ldc + line / 4, 1, 3);
}

// C[0:M, 0:cols] = (accumulate ? C : 0) + A[0:M, 0:kc] . B[0:kc, 0:kNR], from packed operands: PA
// holds A k-major (kMR floats per k, rows past M unused), PB one strip of B (kNR floats per k,
// zero past `cols`), its rows `ldb` floats apart.
template <int M>
static void micro_kernel(int64_t kc, const float* PA, const float* PB, int64_t ldb, float* C, int64_t ldc, int cols,
                         bool accumulate, Prefetch& next_panel) {
  Prefetch pf = next_panel;  // a local copy lives in registers: the reference would be a load and a store each k
  vf c[M][kNV];
  const bool full = cols == kNR;
  float tail[M][kNR];
  if (!full && accumulate)
    for (int i = 0; i < M; ++i) std::memcpy(tail[i], C + i * ldc, cols * sizeof(float));
  for (int i = 0; i < M; ++i) {
    const float* row = full ? C + i * ldc : tail[i];
    for (int j = 0; j < kNV; ++j) c[i][j] = accumulate ? loadv(row + j * kVW) : vf{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    vf b[kNV];
    for (int j = 0; j < kNV; ++j) b[j] = loadv(PB + k * ldb + j * kVW);
    pf.step();
    for (int i = 0; i < M; ++i) {
      const vf a = splat(PA[k * kMR + i]);
      for (int j = 0; j < kNV; ++j) c[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < M; ++i) {
    float* row = full ? C + i * ldc : tail[i];
    for (int j = 0; j < kNV; ++j) storev(row + j * kVW, c[i][j]);
  }
  if (!full)
    for (int i = 0; i < M; ++i) std::memcpy(C + i * ldc, tail[i], cols * sizeof(float));
  next_panel = pf;
}

using MicroKernel = void (*)(int64_t, const float*, const float*, int64_t, float*, int64_t, int, bool, Prefetch&);

template <int... Ms>
constexpr auto micro_table(std::integer_sequence<int, Ms...>) {
  return std::array<MicroKernel, sizeof...(Ms)>{&micro_kernel<Ms + 1>...};
}
constexpr auto kMicroKernels = micro_table(std::make_integer_sequence<int, kMR>{});  // [m - 1]: m rows

TM_INLINE int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Rows of B per panel: K cut into equal panels of at most kKC rows (1600 = 3 x 534, not 768 + 768 + 64),
// so that every panel's arithmetic is long enough to cover the prefetch of the next one.
TM_INLINE int64_t panel_depth(int64_t K) {
  const int64_t panels = (K + kKC - 1) / kKC;
  return (K + panels - 1) / panels;
}

// A's rows in tiles of at most kMR for the micro-kernel: as few tiles as kMR-row ones, of heights that
// differ by at most one (tile t: rows [t * M / count, (t + 1) * M / count)). 64 rows as 12 x 5 + 4
// ran the 4-row tile at half the micro-kernel's speed; as 11 x 4 + 10 x 2 every tile runs at full
// speed (Zen 4, one thread, 64 x 576 x 3072, best of 100: 108 -> 114 GFLOP/s, as 60 rows).
struct RowTiles {
  int64_t M, count;
  explicit RowTiles(int64_t rows) : M(rows), count((rows + kMR - 1) / kMR) {}
  int64_t start(int64_t t) const { return t * M / count; }
  int rows(int64_t t) const { return int(start(t + 1) - start(t)); }
};

// tile[k * kMR + i] = A[i * K + k] for i < m, k < kc: m rows of A (leading dimension K) k-major.
// Transposed kVW x kVW in registers where the ISA's shuffles allow: element by element, the strided
// stores made packing a prefill's A 4% of its time (SmolLM2, 2048 rows, Zen 4).
static void pack_tile(int64_t m, int64_t kc, const float* A, int64_t K, float* tile) {
  int64_t k = 0;
#if defined(__AVX512F__)
  static_assert(kMR <= 16, "a tile's rows fit one 16-lane vector");
  const __mmask16 rows_mask = __mmask16((1u << kMR) - 1);
  for (; k + 16 <= kc; k += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_loadu_ps(A + i * K + k) : _mm512_setzero_ps();
    // r[i] row i → t[2j], t[2j + 1]: rows 2j, 2j + 1 interleaved, per 128-bit lane
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // → r[4q + c]: in 128-bit lane L, rows 4q..4q+3 of column 4L + c
    for (int q = 0; q < 16; q += 4)
      for (int c = 0; c < 2; ++c) {
        const __m512d lo = _mm512_castps_pd(t[q + c]), hi = _mm512_castps_pd(t[q + c + 2]);
        r[q + 2 * c] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
        r[q + 2 * c + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
      }
    // → column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c] (a 4 x 4 transpose of lanes)
    for (int c = 0; c < 4; ++c) {
      const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
      const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
      const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
      _mm512_mask_storeu_ps(tile + (k + c) * kMR, rows_mask, _mm512_shuffle_f32x4(v0, v2, 0x88));
      _mm512_mask_storeu_ps(tile + (k + 4 + c) * kMR, rows_mask, _mm512_shuffle_f32x4(v1, v3, 0x88));
      _mm512_mask_storeu_ps(tile + (k + 8 + c) * kMR, rows_mask, _mm512_shuffle_f32x4(v0, v2, 0xdd));
      _mm512_mask_storeu_ps(tile + (k + 12 + c) * kMR, rows_mask, _mm512_shuffle_f32x4(v1, v3, 0xdd));
    }
  }
#elif defined(__AVX2__)
  static_assert(kMR <= 8, "a tile's rows fit one 8-lane vector");
  const __m256i rows_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(kMR), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; k + 8 <= kc; k += 8) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = i < m ? _mm256_loadu_ps(A + i * K + k) : _mm256_setzero_ps();
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    // → r[4q + c]: in 128-bit lane L, rows 4q..4q+3 of column 4L + c
    for (int q = 0; q < 8; q += 4) {
      r[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
      r[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xee);
      r[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
      r[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xee);
    }
    for (int c = 0; c < 4; ++c) {
      _mm256_maskstore_ps(tile + (k + c) * kMR, rows_mask, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
      _mm256_maskstore_ps(tile + (k + 4 + c) * kMR, rows_mask, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
    }
  }
#endif
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = k; kk < kc; ++kk) tile[kk * kMR + i] = A[i * K + kk];
}

// A[M, K] (row-major) → for each panel of columns k0 (panel_depth(K) of them) and each row tile t
// (RowTiles), a kc x kMR k-major tile at PA + k0 * count * kMR + t * kc * kMR; tiles [t_begin, t_end)
// only (t_end < 0: all; the others are left as they are)
static void pack_a(int64_t M, int64_t K, const float* A, float* PA, int64_t t_begin = 0, int64_t t_end = -1) {
  const RowTiles tiles(M);
  const int64_t m_pad = tiles.count * kMR;
  const int64_t depth = panel_depth(K);
  if (t_end < 0) t_end = tiles.count;
  for (int64_t k0 = 0; k0 < K; k0 += depth) {
    const int64_t kc = std::min(depth, K - k0);
    for (int64_t t = t_begin; t < t_end; ++t)
      pack_tile(tiles.rows(t), kc, A + tiles.start(t) * K + k0, K, PA + k0 * m_pad + t * kc * kMR);
  }
}

// kVW int8 values → float32 (GCC's generic conversion goes one lane at a time: use the ISA's)
TM_INLINE vf int8_to_float(const char* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  float values[kVW];
  for (int j = 0; j < kVW; ++j) values[j] = float(reinterpret_cast<const int8_t*>(p)[j]);
  return loadv(values);
#endif
}

// kVW 4-bit codes (kVW / 2 bytes, two per byte, low nibble first) → float32
TM_INLINE vf uint4_to_float(const char* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
#elif defined(__AVX2__)
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i bytes = _mm_cvtsi32_si128(word);
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
#else
  float values[kVW];
  for (int j = 0; j < kVW; ++j) values[j] = float((static_cast<uint8_t>(p[j / 2]) >> (4 * (j % 2))) & 0x0f);
  return loadv(values);
#endif
}

// A strip's row of kStrip 4-bit codes (kStrip / 2 bytes) → its kStrip / kVW vectors of float32: one
// load and one split of the nibbles for the whole row (the GEMV's decode is its bottleneck)
TM_INLINE void uint4_row_to_float(const char* p, vf* out) {
  static_assert(kStrip == 32, "a row of 16 bytes");
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);  // codes 0-15, 16-31
#if defined(__AVX512F__)
  out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
  out[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
#else
  out[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
  out[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
  out[2] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
  out[3] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
#endif
#else
  for (int v = 0; v < kStrip / kVW; ++v) out[v] = uint4_to_float(p + v * kVW / 2);
#endif
}

// B[k0:k0+kc, n0:n0+nc] → strips of kNR columns, each kc x kNR contiguous float32, zero-padded;
// 8-bit values are decoded and scaled here, one panel at a time
static void pack_b(int64_t kc, int64_t nc, const Weights& B, int64_t k0, int64_t n0, float* PB) {
  const int64_t strips = (nc + kNR - 1) / kNR;
  for (int64_t k = 0; k < kc; ++k) {
    const float* scale = B.scale == nullptr ? nullptr : B.scale + ((k0 + k) / B.wsz) * B.N + n0;
    for (int64_t s = 0; s < strips; ++s) {
      float* dst = PB + (s * kc + k) * kNR;
      const int64_t first = s * kNR, n = std::min<int64_t>(kNR, nc - first);
      const char* row = B.address(k0 + k, n0 + first);  // n values on (in strips, n0 starts a strip)
      if (scale == nullptr) {
        std::memcpy(dst, row, n * sizeof(float));
      } else if (B.is_uint4) {  // in strips: n == kNR
        const float* offset = B.offset + ((k0 + k) / B.wsz) * B.N + n0 + first;
        for (int v = 0; v < kNV; ++v)
          storev(dst + v * kVW, uint4_to_float(row + v * kVW / 2) * loadv(scale + first + v * kVW) + loadv(offset + v * kVW));
      } else if (B.is_int8 && n == kNR) {
        for (int v = 0; v < kNV; ++v)
          storev(dst + v * kVW, int8_to_float(row + v * kVW) * loadv(scale + first + v * kVW));
      } else if (B.is_int8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(row);
        for (int64_t j = 0; j < n; ++j) dst[j] = float(q[j]) * scale[first + j];
      } else {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(row);
        for (int64_t j = 0; j < n; ++j) dst[j] = B.table[q[j]] * scale[first + j];
      }
      if (n < kNR) std::memset(dst + n, 0, (kNR - n) * sizeof(float));
    }
  }
}

// Packing space for gemm: A for up to `rows` x `depth`, one B panel.
struct GemmBuffers {
  std::vector<float> a, b;
  GemmBuffers(int64_t rows, int64_t depth) : a(round_up(rows, kMR) * depth), b(kKC * round_up(kNC, kNR)) {}
};

// A few rows times B, read once straight from memory: at a batch of one to four rows, packing B
// would cost more than the arithmetic it feeds. y[0:M, n0:n1] = x[0:M, 0:K] . B[:, n0:n1], x and y
// row-major (leading dimensions K and N).
constexpr int kGemvRows = 4;
constexpr int kGemvVectors = 4;  // columns per pass: kGemvVectors vectors of each row of B
static_assert(kGemvVectors * kVW % kStrip == 0, "a GEMV's blocks of columns are whole strips");


// What B's values are, as a template argument: the GEMVs' inner loops then hold no branch on it
// (a run-time test there kept the compiler from keeping the decoded weights in registers).
enum class Kind { kFloat32, kInt8, kFloat8, kUint4 };

// The kVW values of B at `p` as float32, scaled by the kVW scales at `scale` (unused for float32
// weights; 4-bit codes are decoded a strip's row at a time, in gemv_strips). Value by value, as
// pack_b does: the GEMV and the GEMM then run the same chain of FMAs for every output, so a row's
// result does not depend on how many rows share the call (batch invariance).
template <Kind kind>
TM_INLINE vf decode(const Weights& B, const char* p, const float* scale) {
  if constexpr (kind == Kind::kFloat32) {
    return loadv(reinterpret_cast<const float*>(p));
  } else if constexpr (kind == Kind::kInt8) {
    return int8_to_float(p) * loadv(scale);
  } else {
    float decoded[kVW];
    for (int j = 0; j < kVW; ++j) decoded[j] = B.table[static_cast<uint8_t>(p[j])];
    return loadv(decoded) * loadv(scale);
  }
}

TM_INLINE float load_weight(const Weights& B, int64_t k, int64_t n) {
  const char* at = B.address(k, n);
  if (B.scale == nullptr) return *reinterpret_cast<const float*>(at);
  const float scale = B.scale[(k / B.wsz) * B.N + n];
  return (B.is_int8 ? float(*reinterpret_cast<const int8_t*>(at)) : B.table[static_cast<uint8_t>(*at)]) * scale;
}

// gemv for row-major B
template <int M, Kind kind>
static void gemv(int64_t K, const float* x, const Weights& B, float* y, int64_t n0, int64_t n1) {
  constexpr int64_t cols = kGemvVectors * kVW;
  const int64_t window = kind == Kind::kFloat32 ? K : B.wsz;
  int64_t n = n0;
  for (; n + cols <= n1; n += cols) {
    vf acc[M][kGemvVectors] = {};
    for (int64_t k0 = 0; k0 < K; k0 += window) {
      const float* scale = kind == Kind::kFloat32 ? nullptr : B.scale + (k0 / window) * B.N + n;
      for (int64_t k = k0; k < k0 + window; ++k) {
        const char* row = B.address(k, n);
        __builtin_prefetch(row + 16 * B.N * B.elem, 0, 3);
        vf b[kGemvVectors];
        for (int j = 0; j < kGemvVectors; ++j) b[j] = decode<kind>(B, row + j * kVW * B.elem, scale + j * kVW);
        for (int m = 0; m < M; ++m) {
          const vf a = splat(x[m * K + k]);
          for (int j = 0; j < kGemvVectors; ++j) acc[m][j] += a * b[j];
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kGemvVectors; ++j) storev(y + m * B.N + n + j * kVW, acc[m][j]);
  }
  for (; n < n1; ++n)  // the columns past the last whole pass (small models)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = lane_fma(x[m * K + k], load_weight(B, k, n), acc);
      y[m * B.N + n] = acc;
    }
}

// Each 8- or 4-bit strip is prefetched this many bytes ahead of its reads (64 rows of int8, 128 of 4-bit
// codes): at 16 rows, 8-bit decode steps ran 5-7% slower (W2 int8) and 30 layers of int8 GEMVs 10-14%
// slower, their streams too short to hide DRAM's latency. Float32 strips are not prefetched in software:
// their rows are 4x the bytes, which the hardware's prefetchers follow alone, and the prefetches only
// took load slots (SmolLM2's float32 decode step, Zen 4, 12 alternating rounds: 21.3 ms median with
// them, 20.8 without, 11 rounds of 12 faster; int8 and 4-bit showed no difference either way).
constexpr int64_t kGemvPrefetchBytes = 2048;

// gemv for B stored in strips (n0, n1 whole strips): each strip is one contiguous stream. S strips
// at a time: each output is one chain of dependent FMAs (in k order, as in the GEMM), so the chains
// of several strips keep the FMA units busy where one strip's row is few bytes (8-bit weights).
template <int M, int S, Kind kind>
static void gemv_strips(int64_t K, const float* x, const Weights& B, float* y, int64_t n0, int64_t n1) {
  constexpr int kV = kStrip / kVW;
  constexpr int64_t row_bytes = kind == Kind::kFloat32 ? kStrip * 4 : kind == Kind::kUint4 ? kStrip / 2 : kStrip;
  constexpr int64_t vector_bytes = row_bytes / kV;
  constexpr int64_t kAheadRows = kGemvPrefetchBytes / row_bytes;
  const int64_t window = kind == Kind::kFloat32 ? K : B.wsz;
  int64_t n = n0;
  for (; n + S * kStrip <= n1; n += S * kStrip) {
    const char* strip[S];
    for (int s = 0; s < S; ++s) strip[s] = B.address(0, n + s * kStrip);
    vf acc[M][S][kV] = {};
    for (int64_t k0 = 0; k0 < K; k0 += window) {
      const float* scale = kind == Kind::kFloat32 ? nullptr : B.scale + (k0 / window) * B.N + n;
      const float* offset = kind == Kind::kUint4 ? B.offset + (k0 / window) * B.N + n : nullptr;
      for (int64_t k = k0; k < k0 + window; ++k) {
        if constexpr (kind != Kind::kFloat32)
          for (int s = 0; s < S; ++s)
            for (int64_t line = 0; line < row_bytes; line += 64)
              __builtin_prefetch(strip[s] + (k + kAheadRows) * row_bytes + line, 0, 3);
        vf b[S][kV];
        for (int s = 0; s < S; ++s) {
          if constexpr (kind == Kind::kUint4) {  // code * scale + offset, as pack_b decodes them
            uint4_row_to_float(strip[s] + k * row_bytes, b[s]);
            for (int j = 0; j < kV; ++j)
              b[s][j] = b[s][j] * loadv(scale + s * kStrip + j * kVW) + loadv(offset + s * kStrip + j * kVW);
          } else {
            for (int j = 0; j < kV; ++j)
              b[s][j] = decode<kind>(B, strip[s] + k * row_bytes + j * vector_bytes, scale + s * kStrip + j * kVW);
          }
        }
        for (int m = 0; m < M; ++m) {
          const vf a = splat(x[m * K + k]);
          for (int s = 0; s < S; ++s)
            for (int j = 0; j < kV; ++j) acc[m][s][j] += a * b[s][j];
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < S; ++s)
        for (int j = 0; j < kV; ++j) storev(y + m * B.N + n + s * kStrip + j * kVW, acc[m][s][j]);
  }
  if (n < n1) gemv_strips<M, 1, kind>(K, x, B, y, n, n1);
}

template <int M, Kind kind>
static void gemv_of(int64_t K, const float* x, const Weights& B, float* y, int64_t n0, int64_t n1) {
  // a float32 strip's row is enough bytes to keep the FMA units busy alone; 8- and 4-bit ones go
  // two by two
  if constexpr (kind == Kind::kUint4)  // in strips only
    gemv_strips<M, 2, kind>(K, x, B, y, n0, n1);
  else if (B.strip_stride != 0)
    gemv_strips<M, kind == Kind::kFloat32 ? 1 : 2, kind>(K, x, B, y, n0, n1);
  else
    gemv<M, kind>(K, x, B, y, n0, n1);
}

template <int M>
static void gemv_of(int64_t K, const float* x, const Weights& B, float* y, int64_t n0, int64_t n1) {
  if (B.scale == nullptr)
    gemv_of<M, Kind::kFloat32>(K, x, B, y, n0, n1);
  else if (B.is_uint4)
    gemv_of<M, Kind::kUint4>(K, x, B, y, n0, n1);
  else if (B.is_int8)
    gemv_of<M, Kind::kInt8>(K, x, B, y, n0, n1);
  else
    gemv_of<M, Kind::kFloat8>(K, x, B, y, n0, n1);
}

// Float32 strips take the GEMV up to this many rows: a strip's row is two vectors, so 8 rows keep
// 16 accumulators in registers, and 5 to 8 rows (a step verifying speculative tokens, a decode batch
// of 5 to 8) still read B once, straight from memory, with no packing. SmolLM2's float32 step of one
// request's 5 / 8 tokens at 320 keys, against its 1-token step, 3 alternating runs: 1.26 / 1.31x with
// the packed GEMM (and attention's one tile), 1.16 / 1.22x with this GEMV (and the tile cut per token).
// 8- and 4-bit weights, two strips at a time, have no registers to spare.
constexpr int kGemvRowsFloat32Strips = 8;

TM_INLINE int64_t gemv_max_rows(const Weights& B) {
  return B.scale == nullptr && B.strip_stride != 0 ? kGemvRowsFloat32Strips : kGemvRows;
}

// M <= gemv_max_rows(B)
static void gemv_rows(int64_t M, int64_t K, const float* x, const Weights& B, float* y, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return gemv_of<1>(K, x, B, y, n0, n1);
    case 2: return gemv_of<2>(K, x, B, y, n0, n1);
    case 3: return gemv_of<3>(K, x, B, y, n0, n1);
    case 4: return gemv_of<4>(K, x, B, y, n0, n1);
    case 5: return gemv_strips<5, 1, Kind::kFloat32>(K, x, B, y, n0, n1);
    case 6: return gemv_strips<6, 1, Kind::kFloat32>(K, x, B, y, n0, n1);
    case 7: return gemv_strips<7, 1, Kind::kFloat32>(K, x, B, y, n0, n1);
    default: return gemv_strips<8, 1, Kind::kFloat32>(K, x, B, y, n0, n1);
  }
}

// Rows of A per pass over a packed strip of B (eight tiles): a kMC x kKC block of packed A stays in L2.
constexpr int64_t kMC = 8 * kMR;

// What the caller multiplies next, if it knows: columns [n_begin, n_end) of a B[K, N] (another
// matrix, or other columns of this one), whose first panel gemm_packed prefetches during its last.
struct NextBlock {
  const Weights* B = nullptr;
  int64_t n_begin = 0, n_end = 0, K = 0;
};

// C[rows of tiles t_begin..t_end, n_begin:n_end] = A . B[:, n_begin:n_end] for A packed by pack_a (C
// row-major, N columns; t_end < 0: every tile); `panel` holds one packed panel of B (float32 B
// stored in strips is read in place; in strips, n_begin and n_end are whole strips). Each panel of
// B is prefetched while the one before it is multiplied; the first, while the caller's previous
// call (`next` there) ran.
static void gemm_packed(int64_t M, int64_t N, int64_t K, const float* PA, const Weights& B, float* C, float* panel,
                        int64_t n_begin, int64_t n_end, const NextBlock& next = {}, int64_t t_begin = 0,
                        int64_t t_end = -1) {
  const RowTiles tiles(M);
  const int64_t m_pad = tiles.count * kMR;
  const int64_t depth = panel_depth(K);
  if (t_end < 0) t_end = tiles.count;
  const bool in_place = B.strip_stride != 0 && B.scale == nullptr;  // float32 strips: read where they lie
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kNC) {
    const int64_t nc = std::min(kNC, n_end - n0);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t kc = std::min(depth, K - k0);
      if (!in_place) pack_b(kc, nc, B, k0, n0, panel);
      Prefetch pf;
      if (k0 + depth < K)
        pf = Prefetch(B, k0 + depth, n0, std::min(depth, K - k0 - depth), nc);
      else if (n0 + kNC < n_end)
        pf = Prefetch(B, 0, n0 + kNC, depth, std::min(kNC, n_end - n0 - kNC));
      else if (next.B != nullptr)
        pf = Prefetch(*next.B, 0, next.n_begin, panel_depth(next.K), std::min(kNC, next.n_end - next.n_begin));
      for (int64_t tc = t_begin; tc < t_end; tc += kMC / kMR) {
        const int64_t tc_end = std::min(t_end, tc + kMC / kMR);
        for (int64_t s = 0; s * kNR < nc; ++s) {
          const int cols = int(std::min<int64_t>(kNR, nc - s * kNR));
          const float* strip = in_place ? B.strip_at(k0, n0 + s * kNR) : panel + s * kc * kNR;
          for (int64_t t = tc; t < tc_end; ++t) {
            // the C tile of the next call, whose rows lie N floats apart (beyond the hardware's
            // prefetchers): in cache by the time that call loads (or stores) it
            if (t + 1 < tc_end)
              prefetch_tile(C + tiles.start(t + 1) * N + n0 + s * kNR, N, tiles.rows(t + 1));
            else if ((s + 1) * kNR < nc)
              prefetch_tile(C + tiles.start(tc) * N + n0 + (s + 1) * kNR, N, tiles.rows(tc));
            kMicroKernels[tiles.rows(t) - 1](kc, PA + k0 * m_pad + t * kc * kMR, strip, in_place ? kStrip : kNR,
                                             C + tiles.start(t) * N + n0 + s * kNR, N, cols, k0 > 0, pf);
          }
        }
      }
    }
  }
}

// C[M, N] = A[M, K] . B[K, N], all row-major (leading dimensions K, N, N).
static void gemm(int64_t M, int64_t N, int64_t K, const float* A, const Weights& B, float* C, GemmBuffers& buf,
                 const NextBlock& next = {}) {
  pack_a(M, K, A, buf.a.data());
  gemm_packed(M, N, K, buf.a.data(), B, C, buf.b.data(), 0, N, next);
}

// C = A . B by whichever of gemv (up to gemv_max_rows(B) rows) and gemm suits M.
static void matmul(int64_t M, int64_t N, int64_t K, const float* A, const Weights& B, float* C, GemmBuffers& buf,
                   const NextBlock& next = {}) {
  if (M <= gemv_max_rows(B))
    gemv_rows(M, K, A, B, C, 0, N);
  else
    gemm(M, N, K, A, B, C, buf, next);
}

}  // namespace
