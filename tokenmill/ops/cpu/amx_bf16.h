// A bfloat16 GEMM on AMX tiles, for linear.cc's `bf16` mode (--quantization w8a16):
//
//   C[M, N] = bf16(A)[M, K] . B[K, N]      B 8-bit codes with one float32 scale per window (gemm.h)
//
// An 8-bit code (int8, or float8's 2-3 significant bits) is exactly a bfloat16, and so is the
// product of two bfloat16 values a float32: TDPBF16PS sums each window's products of A's rounded
// values and B's unscaled codes in float32, then the window's sum is scaled by its column's scale
// and added to a float32 accumulator. That is what linear_ref computes with the float32 weights
// q * scale, up to the order of the additions (and denormals, which AMX flushes).
//
// A is converted once to a zero-padded bfloat16 [m_pad, k_pad] copy. A block of B's columns is
// packed into strips of 16 columns, each [k_pad / 2][16][2] bfloat16 (the pairs of k that one tile
// row holds), and kept while every 32 rows of A meet it: 2 x 2 tiles of C (32 x 32 float32) take
// 4 TDPBF16PS per 32 of k, from 2 tiles of A and 2 of B. A row's result never depends on the other
// rows in its tile, so the output is batch-invariant.
//
// Compiled only where the build enables AMX-TILE, AMX-BF16 and AVX512-BF16 (build.py, from
// /proc/cpuinfo); Linux grants the tile state to a process that asks (amx_ready).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENMILL_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "gemm.h"

namespace {

constexpr int kTileRows = 16;  // rows of an A or C tile
constexpr int kTileK = 32;  // bfloat16 values of k per A tile row (64 bytes)
constexpr int kTileCols = 16;  // float32 columns of a C tile
constexpr int64_t kStripValues = kTileCols * 2;  // bfloat16 per packed row of a strip: 16 columns x 2 k

// Whether this process may use the tiles: Linux hands out the AMX state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process.
static bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// The k per scale window the tiles can follow: a multiple of a tile's 32, or one window over all
// of K (its padding is zeros). 0: the windows do not fit the tiles.
static int64_t amx_window(int64_t wsz, int64_t K, int64_t k_pad) {
  if (wsz >= K) return k_pad;
  return wsz % kTileK == 0 ? wsz : 0;
}

// Palette 1, all eight tiles 16 rows x 64 bytes: C in 0-3, A in 4-5, B in 6-7. Loaded by every
// thread that multiplies (the configuration is per thread).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

static void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
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

// Rows [m, m + 16 * MT) x strips [s, s + NT) of C, window by window: the window's tile sums are
// stored, scaled by their columns' scales and added to a float32 accumulator, which goes to C at
// the end (through the part that lies inside M x N).
template <int MT, int NT>
static void amx_tiles(int64_t M, int64_t N, const uint16_t* PA, int64_t k_pad, const uint16_t* strips,
                      int64_t strip_size, const Weights& B, int64_t window, int64_t m, int64_t s, int64_t n0,
                      float* C) {
  constexpr int rows = MT * kTileRows, cols = NT * kTileCols;
  alignas(64) float sums[rows * cols];
  alignas(64) float acc[rows * cols] = {};
  const uint16_t* a = PA + m * k_pad;
  const uint16_t* b = strips + s * strip_size;
  const int64_t a_stride = k_pad * 2;
  const int64_t col0 = n0 + s * kTileCols;
  for (int64_t k0 = 0; k0 < k_pad; k0 += window) {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    for (int64_t k = k0; k < k0 + window; k += kTileK) {
      _tile_loadd(4, a + k, a_stride);
      if constexpr (MT == 2) _tile_loadd(5, a + kTileRows * k_pad + k, a_stride);
      _tile_loadd(6, b + (k / 2) * kStripValues, 64);
      if constexpr (NT == 2) _tile_loadd(7, b + strip_size + (k / 2) * kStripValues, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
      if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums, cols * 4);
    if constexpr (NT == 2) _tile_stored(1, sums + kTileCols, cols * 4);
    if constexpr (MT == 2) _tile_stored(2, sums + kTileRows * cols, cols * 4);
    if constexpr (MT == 2 && NT == 2) _tile_stored(3, sums + kTileRows * cols + kTileCols, cols * 4);
    const float* scale = B.scale + (k0 / B.wsz) * B.N + col0;
    for (int j = 0; j < NT; ++j) {
      const int64_t live = std::min<int64_t>(kTileCols, N - col0 - j * kTileCols);
      const __m512 column_scale =
          _mm512_maskz_loadu_ps(live <= 0 ? 0 : __mmask16((1u << live) - 1), scale + j * kTileCols);
      for (int r = 0; r < rows; ++r) {
        float* out = acc + r * cols + j * kTileCols;
        _mm512_store_ps(out, _mm512_fmadd_ps(_mm512_load_ps(sums + r * cols + j * kTileCols), column_scale,
                                             _mm512_load_ps(out)));
      }
    }
  }
  const int64_t live_rows = std::min<int64_t>(rows, M - m), live_cols = std::min<int64_t>(cols, N - col0);
  for (int64_t r = 0; r < live_rows; ++r) std::memcpy(C + (m + r) * N + col0, acc + r * cols, live_cols * 4);
}

// C[:, n_begin:n_end] = bf16(A) . B[:, n_begin:n_end], A packed by pack_a_bf16, B with scales whose
// windows fit (amx_window gives `window`); `strips` has room for the block's strips.
static void amx_gemm_columns(int64_t M, int64_t N, int64_t K, const uint16_t* PA, int64_t m_pad, int64_t k_pad,
                             const Weights& B, int64_t window, float* C, uint16_t* strips, int64_t n_begin,
                             int64_t n_end) {
  const int64_t strip_size = (k_pad / 2) * kStripValues;
  const int64_t count = (n_end - n_begin + kTileCols - 1) / kTileCols;
  pack_strips_bf16(B, K, k_pad, n_begin, n_end, strips, strip_size);
  configure_tiles();
  for (int64_t m = 0; m < m_pad; m += 2 * kTileRows) {
    const bool two_rows = m + kTileRows < m_pad;
    for (int64_t s = 0; s < count; s += 2) {
      const bool two_cols = s + 1 < count;
      if (two_rows && two_cols)
        amx_tiles<2, 2>(M, N, PA, k_pad, strips, strip_size, B, window, m, s, n_begin, C);
      else if (two_rows)
        amx_tiles<2, 1>(M, N, PA, k_pad, strips, strip_size, B, window, m, s, n_begin, C);
      else if (two_cols)
        amx_tiles<1, 2>(M, N, PA, k_pad, strips, strip_size, B, window, m, s, n_begin, C);
      else
        amx_tiles<1, 1>(M, N, PA, k_pad, strips, strip_size, B, window, m, s, n_begin, C);
    }
  }
  _tile_release();
}

}  // namespace

#endif
