// The bfloat16 GEMM of bf16_pack.h on AMX tiles: 2 x 2 tiles of C (32 x 32 float32) take 4
// TDPBF16PS per 32 of k, from 2 tiles of A and 2 of B; a block of B's strips is kept while every 32
// rows of A meet it. A row's result never depends on the other rows in its tile, so the output is
// batch-invariant.
//
// Compiled only where the build enables AMX-TILE and AMX-BF16 besides AVX512-BF16 (build.py, from
// /proc/cpuinfo); Linux grants the tile state to a process that asks (amx_ready).

#pragma once

#include "bf16_pack.h"

#if defined(TOKENMILL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Whether this process may use the tiles: Linux hands out the AMX state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process.
static bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
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
// windows fit (bf16_window gives `window`); `strips` has room for the block's strips.
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
