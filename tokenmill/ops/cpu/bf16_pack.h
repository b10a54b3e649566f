// bfloat16 operands for linear.cc's `bf16` mode (--quantization w8a16), laid out for the CPU's
// bfloat16 dot products: AMX tiles (amx_bf16.h) or AVX512-BF16's VDPBF16PS (avx512_bf16.h).
//
//   C[M, N] = bf16(A)[M, K] . B[K, N]      B 8-bit codes with one float32 scale per window (gemm.h)
//
// An 8-bit code (int8, or float8's 2-3 significant bits) is exactly a bfloat16, and so is the
// product of two bfloat16 values a float32: both instructions sum a window's products of A's
// rounded values and B's unscaled codes in float32; the window's sum is then scaled by its column's
// scale and added to a float32 accumulator. That is what linear_ref computes with the float32
// weights q * scale, up to the order of the additions (and denormals, which both flush).
//
// A is converted once to a zero-padded bfloat16 [m_pad, k_pad] copy. A block of B's columns is
// packed into strips of 16 columns, each [k_pad / 2][16][2] bfloat16: the pairs of k that one
// 64-byte tile row, or one 512-bit register, holds.
//
// Compiled only where the build enables AVX512-BF16 (build.py, from /proc/cpuinfo).

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TOKENMILL_BF16 1

#include <immintrin.h>

#include <cstdint>

#include "gemm.h"

namespace {

constexpr int kTileRows = 16;  // A's rows are padded to a multiple of an AMX tile's 16 rows
constexpr int kTileK = 32;  // and its k to one of a tile row's 32 bfloat16 values (64 bytes)
constexpr int kTileCols = 16;  // float32 columns of a C tile, and of a packed strip of B
constexpr int64_t kStripValues = kTileCols * 2;  // bfloat16 per packed row of a strip: 16 columns x 2 k

// The k per scale window the packed operands can follow: a multiple of 32, or one window over all
// of K (its padding is zeros). 0: the windows do not fit (linear.cc then takes the float32 path).
static int64_t bf16_window(int64_t wsz, int64_t K, int64_t k_pad) {
  if (wsz >= K) return k_pad;
  return wsz % kTileK == 0 ? wsz : 0;
}

// A[M, K] → bfloat16 [m_pad, k_pad], row-major, rounded to nearest even, zero past M and K
static void pack_a_bf16(int64_t M, int64_t K, const float* A, uint16_t* PA, int64_t m_pad, int64_t k_pad) {
  for (int64_t m = 0; m < m_pad; ++m) {
    uint16_t* row = PA + m * k_pad;
    for (int64_t k = 0; k < k_pad; k += 16) {
      const __mmask16 live = m < M && k < K ? __mmask16((K - k >= 16) ? 0xffff : (1u << (K - k)) - 1) : 0;
      const __m512 values = _mm512_maskz_loadu_ps(live, A + m * K + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), (__m256i)_mm512_cvtneps_pbh(values));
    }
  }
}

// Columns [n, n + cols) of row k of B's 8-bit codes, unscaled, as float32 (zero past cols)
TM_INLINE __m512 codes_row(const Weights& B, int64_t k, int64_t n, int cols) {
  const char* row = B.address(k, n);  // (in strips too, as n starts a tile of a strip's columns)
  if (B.is_int8 && cols == kTileCols) return (__m512)int8_to_float(row);
  alignas(64) float values[kTileCols] = {};
  for (int j = 0; j < cols; ++j)
    values[j] = B.is_int8 ? float(reinterpret_cast<const int8_t*>(row)[j]) : B.table[static_cast<uint8_t>(row[j])];
  return _mm512_load_ps(values);
}

// Columns [n0, n1) of B's codes → strips of 16 columns, `strip_size` values apart, each
// [k_pad / 2][16][2] bfloat16: row k / 2 of a strip holds (B[k, n], B[k + 1, n]) for each of its
// columns n; zero past K and past n1. Row pair by row pair across every strip, so that each row of
// B is read once.
static void pack_strips_bf16(const Weights& B, int64_t K, int64_t k_pad, int64_t n0, int64_t n1, uint16_t* strips,
                             int64_t strip_size) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t count = (n1 - n0 + kTileCols - 1) / kTileCols;
  // B's rows are N bytes apart (in strips, kStrip bytes of each strip's): fetch the block's bytes of
  // the rows kPrefetchRows ahead, which the hardware prefetcher does not see coming
  constexpr int64_t kPrefetchRows = 16;
  const int64_t run = B.strip_stride == 0 ? 64 : kStrip;  // columns whose bytes of a row are contiguous
  for (int64_t k = 0; k < k_pad; k += 2) {
    for (int64_t ahead = k + kPrefetchRows; ahead < std::min(K, k + kPrefetchRows + 2); ++ahead)
      for (int64_t n = n0; n < n1; n += run) __builtin_prefetch(B.address(ahead, n), 0, 3);
    uint16_t* out = strips + (k / 2) * kStripValues;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t n = n0 + s * kTileCols;
      const int cols = int(std::min<int64_t>(kTileCols, n1 - n));
      const __m512 even = k < K ? codes_row(B, k, n, cols) : _mm512_setzero_ps();
      const __m512 odd = k + 1 < K ? codes_row(B, k + 1, n, cols) : _mm512_setzero_ps();
      // [B[k, n..n+15], B[k + 1, n..n+15]] as bfloat16 (exact), then paired column by column
      const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
      _mm512_storeu_si512(out + s * strip_size, _mm512_permutexvar_epi16(interleave, halves));
    }
  }
}

}  // namespace

#endif
