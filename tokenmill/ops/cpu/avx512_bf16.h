// The bfloat16 GEMM of bf16_pack.h on AVX512-BF16's VDPBF16PS, for CPUs without AMX (AMD Zen 4 and
// later; Intel Cooper Lake): one instruction adds 16 columns' products of a pair of k, twice the
// multiply-adds of a float32 FMA (Zen 4: 235 against 117 GFLOP/s a core, measured).
//
// A register block of kDotRows rows x 2 strips (32 columns) keeps each window's sums and the scaled
// accumulators in 24 of the 32 registers; per pair of k, the two strips' 64 bytes are loaded and
// each row's pair is broadcast. Every row runs the same chain of instructions whatever the rows
// beside it, so the output is batch-invariant.

#pragma once

#include "bf16_pack.h"

#if defined(TOKENMILL_BF16)

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

constexpr int kDotRows = 6;

// Rows [m, m + R) x strips [s, s + NT) of C (R <= kDotRows, m + R <= M): per window,
// the bfloat16 pair products summed in float32, then scaled by their columns' scales into the
// accumulators, which go to C at the end (the part inside M x N).
template <int R, int NT>
static void dot_tile(int64_t M, int64_t N, const uint16_t* PA, int64_t k_pad, const uint16_t* strips,
                     int64_t strip_size, const Weights& B, int64_t window, int64_t m, int64_t s, int64_t n0,
                     float* C) {
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t col0 = n0 + s * kTileCols;
  __mmask16 live[NT];
  for (int j = 0; j < NT; ++j) {
    const int64_t cols = std::min<int64_t>(kTileCols, N - col0 - j * kTileCols);
    live[j] = cols <= 0 ? 0 : cols == kTileCols ? 0xffff : __mmask16((1u << cols) - 1);
  }
  const uint16_t* a = PA + m * k_pad;
  const uint16_t* b = strips + s * strip_size;
  for (int64_t k0 = 0; k0 < k_pad; k0 += window) {
    __m512 sum[R][NT];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + window; k += 2) {
      __m512bh pairs[NT];
      for (int j = 0; j < NT; ++j)
        pairs[j] = (__m512bh)_mm512_loadu_si512(b + j * strip_size + (k / 2) * kStripValues);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + i * k_pad + k, 4);
        const __m512bh row = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], row, pairs[j]);
      }
    }
    const float* scale = B.scale + (k0 / B.wsz) * B.N + col0;
    for (int j = 0; j < NT; ++j) {
      const __m512 column_scale = _mm512_maskz_loadu_ps(live[j], scale + j * kTileCols);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(sum[i][j], column_scale, acc[i][j]);
    }
  }
  const int live_rows = int(std::min<int64_t>(R, M - m));
  for (int i = 0; i < live_rows; ++i)
    for (int j = 0; j < NT; ++j) _mm512_mask_storeu_ps(C + (m + i) * N + col0 + j * kTileCols, live[j], acc[i][j]);
}

using DotTile = void (*)(int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, const Weights&, int64_t,
                         int64_t, int64_t, int64_t, float*);

template <int NT, int... Rs>
constexpr auto dot_table(std::integer_sequence<int, Rs...>) {
  return std::array<DotTile, sizeof...(Rs)>{&dot_tile<Rs + 1, NT>...};
}
constexpr auto kDotTiles1 = dot_table<1>(std::make_integer_sequence<int, kDotRows>{});  // [rows - 1]: one strip
constexpr auto kDotTiles2 = dot_table<2>(std::make_integer_sequence<int, kDotRows>{});  // two strips

// C[:, n_begin:n_end] = bf16(A) . B[:, n_begin:n_end], A packed by pack_a_bf16, B with scales whose
// windows fit (bf16_window gives `window`); `strips` has room for the block's strips. Each kDotRows
// rows of A (in L1) meet every strip of the block (in L2).
static void dot_gemm_columns(int64_t M, int64_t N, int64_t K, const uint16_t* PA, int64_t k_pad, const Weights& B,
                             int64_t window, float* C, uint16_t* strips, int64_t n_begin, int64_t n_end) {
  const int64_t strip_size = (k_pad / 2) * kStripValues;
  const int64_t count = (n_end - n_begin + kTileCols - 1) / kTileCols;
  pack_strips_bf16(B, K, k_pad, n_begin, n_end, strips, strip_size);
  for (int64_t m = 0; m < M; m += kDotRows) {
    const int rows = int(std::min<int64_t>(kDotRows, M - m));
    for (int64_t s = 0; s < count; s += 2)
      (s + 1 < count ? kDotTiles2 : kDotTiles1)[rows - 1](M, N, PA, k_pad, strips, strip_size, B, window, m, s,
                                                          n_begin, C);
  }
}

// Decoding (up to kGemvRows rows) with int8 weights in strips and K a multiple of 32: packing a
// block of B for a row or two cost more than its products (30 layers of SmolLM2 at 1 row: 14.5 ms,
// against 5.8 on the float32 path). Here each pair of rows of a strip is converted in registers,
// into exactly the pairs pack_strips_bf16 makes, and meets every row's pair: the same dot products,
// window sums and scaling as dot_tile, so a row's result is the GEMM's bit for bit (batch
// invariance). Two strips at a time, for four independent chains of sums per row.
TM_INLINE __m512bh int8_pairs(const char* row, const char* next) {
  const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(next));
  // (B[k, j], B[k + 1, j]) byte pairs for columns 0-7, then 8-15, widened to float32 (exact)
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(even, odd)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(even, odd)));
  return _mm512_cvtne2ps_pbh(high, low);
}

template <int M>
static void dot_gemv_strips(int64_t K, const uint16_t* PA, const Weights& B, int64_t window, float* C, int64_t n0,
                            int64_t n1) {
  constexpr int S = 2, kHalves = kStrip / kTileCols;
  constexpr int64_t kAheadRows = kGemvPrefetchBytes / kStrip;
  int64_t n = n0;
  for (; n < n1; n += S * kStrip) {
    const int strips = n + S * kStrip <= n1 ? S : 1;
    const char* strip[S];
    for (int s = 0; s < S; ++s) strip[s] = B.address(0, n + std::min(s, strips - 1) * kStrip);
    __m512 acc[M][S][kHalves];
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < kHalves; ++h) acc[m][s][h] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += window) {
      __m512 sum[M][S][kHalves];
      for (int m = 0; m < M; ++m)
        for (int s = 0; s < S; ++s)
          for (int h = 0; h < kHalves; ++h) sum[m][s][h] = _mm512_setzero_ps();
      for (int64_t k = k0; k < k0 + window; k += 2) {
        for (int s = 0; s < S; ++s) __builtin_prefetch(strip[s] + (k + kAheadRows) * kStrip, 0, 3);
        __m512bh pairs[S][kHalves];
        for (int s = 0; s < S; ++s)
          for (int h = 0; h < kHalves; ++h)
            pairs[s][h] = int8_pairs(strip[s] + k * kStrip + h * kTileCols, strip[s] + (k + 1) * kStrip + h * kTileCols);
        for (int m = 0; m < M; ++m) {
          int32_t pair;
          std::memcpy(&pair, PA + m * K + k, 4);
          const __m512bh row = (__m512bh)_mm512_set1_epi32(pair);
          for (int s = 0; s < S; ++s)
            for (int h = 0; h < kHalves; ++h) sum[m][s][h] = _mm512_dpbf16_ps(sum[m][s][h], row, pairs[s][h]);
        }
      }
      const float* scale = B.scale + (k0 / B.wsz) * B.N + n;
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < kHalves; ++h) {
          const __m512 column_scale = _mm512_loadu_ps(scale + std::min(s, strips - 1) * kStrip + h * kTileCols);
          for (int m = 0; m < M; ++m) acc[m][s][h] = _mm512_fmadd_ps(sum[m][s][h], column_scale, acc[m][s][h]);
        }
    }
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < strips; ++s)
        for (int h = 0; h < kHalves; ++h) _mm512_storeu_ps(C + m * B.N + n + s * kStrip + h * kTileCols, acc[m][s][h]);
  }
}

// Whether dot_gemv_rows can take these weights: int8 in strips, K a multiple of 32 (no padding)
static bool dot_gemv_fits(const Weights& B, int64_t K) {
  return B.is_int8 && B.strip_stride != 0 && K % kTileK == 0;
}

// y[0:M, n0:n1] (whole strips) for M <= kGemvRows, A packed by pack_a_bf16 with k_pad == K
static void dot_gemv_rows(int64_t M, int64_t K, const uint16_t* PA, const Weights& B, int64_t window, float* C,
                          int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return dot_gemv_strips<1>(K, PA, B, window, C, n0, n1);
    case 2: return dot_gemv_strips<2>(K, PA, B, window, C, n0, n1);
    case 3: return dot_gemv_strips<3>(K, PA, B, window, C, n0, n1);
    default: return dot_gemv_strips<4>(K, PA, B, window, C, n0, n1);
  }
}

}  // namespace

#endif
