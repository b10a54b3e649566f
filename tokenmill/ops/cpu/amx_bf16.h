// A bfloat16 GEMM on AMX tiles, for linear.cc's `bf16` mode (--quantization w8a16):
//
//   C[M, N] = A[M, K] . B[K, N]      A float32, B gemm.h's Weights
//
// A is rounded to bfloat16 as it is packed, each weight dequantized and rounded as B is packed
// (ties to even, like gemm.h's round_bf16), then TDPBF16PS sums the
// products (exact in float32) in float32: the numbers gemm.h's float32 path computes with
// `Weights::bf16`, up to the order of the additions (and denormals, which AMX flushes).
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

// Columns [n0, n1) of B → strips of 16 columns, `strip_size` values apart, each [k_pad / 2][16][2]
// bfloat16: row k / 2 of a strip holds (B[k, n], B[k + 1, n]) for each of its columns n; zero past
// K and past n1. Row pair by row pair across every strip, so that each row of B is read once.
static void pack_strips_bf16(const Weights& B, int64_t K, int64_t k_pad, int64_t n0, int64_t n1, uint16_t* strips,
                             int64_t strip_size) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t full = (n1 - n0) / kTileCols;
  const int tail = int((n1 - n0) % kTileCols);
  auto row = [&](int64_t k, int64_t n, const float* scale) -> __m512 {
    if (k >= K) return _mm512_setzero_ps();
    if (n + kTileCols <= n1) return (__m512)decode_weights(B, k, n, scale);
    alignas(64) float values[kTileCols] = {};
    for (int j = 0; j < tail; ++j) values[j] = load_weight(B, k, n + j);
    return _mm512_load_ps(values);
  };
  auto scales_of = [&](int64_t k) { return B.scale == nullptr || k >= K ? nullptr : B.scale + (k / B.wsz) * B.N; };
  // B's rows are N values apart: fetch the block's bytes of the rows kPrefetchRows ahead, which the
  // hardware prefetcher does not see coming
  constexpr int64_t kPrefetchRows = 16;
  const int64_t row_bytes = (n1 - n0) * B.elem;
  for (int64_t k = 0; k < k_pad; k += 2) {
    for (int64_t ahead = k + kPrefetchRows; ahead < std::min(K, k + kPrefetchRows + 2); ++ahead)
      for (int64_t line = 0; line < row_bytes; line += 64)
        __builtin_prefetch(B.data + (ahead * B.N + n0) * B.elem + line, 0, 3);
    const float* scale0 = scales_of(k);
    const float* scale1 = scales_of(k + 1);
    uint16_t* out = strips + (k / 2) * kStripValues;
    for (int64_t s = 0; s < full + (tail > 0); ++s) {
      const int64_t n = n0 + s * kTileCols;
      // [B[k, n..n+15], B[k + 1, n..n+15]] rounded to bfloat16 (ties to even), then paired column by column
      const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(row(k + 1, n, scale1), row(k, n, scale0));
      _mm512_storeu_si512(out + s * strip_size, _mm512_permutexvar_epi16(interleave, halves));
    }
  }
}

// Rows [m, m + 16 * MT) x strips [s, s + NT) of C: the tiles, then stored to C (through a bounce
// buffer where a tile overhangs M or N).
template <int MT, int NT>
static void amx_tiles(int64_t M, int64_t N, const uint16_t* PA, int64_t k_pad, const uint16_t* strips,
                      int64_t strip_size, int64_t m, int64_t s, int64_t n0, float* C) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  const uint16_t* a = PA + m * k_pad;
  const uint16_t* b = strips + s * strip_size;
  const int64_t a_stride = k_pad * 2;
  for (int64_t k = 0; k < k_pad; k += kTileK) {
    _tile_loadd(4, a + k, a_stride);
    if constexpr (MT == 2) _tile_loadd(5, a + kTileRows * k_pad + k, a_stride);
    _tile_loadd(6, b + (k / 2) * kStripValues, 64);
    if constexpr (NT == 2) _tile_loadd(7, b + strip_size + (k / 2) * kStripValues, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float bounce[kTileRows * kTileCols];
  auto store = [&](auto tile, int i, int j) {
    const int64_t row = m + i * kTileRows, col = n0 + (s + j) * kTileCols;
    const int64_t rows = std::min<int64_t>(kTileRows, M - row), cols = std::min<int64_t>(kTileCols, N - col);
    if (rows <= 0 || cols <= 0) return;
    if (rows == kTileRows && cols == kTileCols) {
      tile(C + row * N + col, N * 4);
      return;
    }
    tile(bounce, kTileCols * 4);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(C + (row + r) * N + col, bounce + r * kTileCols, cols * 4);
  };
  store([](float* p, int64_t stride) { _tile_stored(0, p, stride); }, 0, 0);
  if constexpr (NT == 2) store([](float* p, int64_t stride) { _tile_stored(1, p, stride); }, 0, 1);
  if constexpr (MT == 2) store([](float* p, int64_t stride) { _tile_stored(2, p, stride); }, 1, 0);
  if constexpr (MT == 2 && NT == 2) store([](float* p, int64_t stride) { _tile_stored(3, p, stride); }, 1, 1);
}

// C[:, n_begin:n_end] = A . B[:, n_begin:n_end], A packed by pack_a_bf16; `strips` has room for
// the block's strips. B.bf16 is ignored: packing always rounds to bfloat16.
static void amx_gemm_columns(int64_t M, int64_t N, int64_t K, const uint16_t* PA, int64_t m_pad, int64_t k_pad,
                             const Weights& B, float* C, uint16_t* strips, int64_t n_begin, int64_t n_end) {
  Weights exact = B;
  exact.bf16 = false;  // the strip packer rounds pairs at once
  const int64_t strip_size = (k_pad / 2) * kStripValues;
  const int64_t count = (n_end - n_begin + kTileCols - 1) / kTileCols;
  pack_strips_bf16(exact, K, k_pad, n_begin, n_end, strips, strip_size);
  configure_tiles();
  for (int64_t m = 0; m < m_pad; m += 2 * kTileRows) {
    const bool two_rows = m + kTileRows < m_pad;
    for (int64_t s = 0; s < count; s += 2) {
      const bool two_cols = s + 1 < count;
      if (two_rows && two_cols)
        amx_tiles<2, 2>(M, N, PA, k_pad, strips, strip_size, m, s, n_begin, C);
      else if (two_rows)
        amx_tiles<2, 1>(M, N, PA, k_pad, strips, strip_size, m, s, n_begin, C);
      else if (two_cols)
        amx_tiles<1, 2>(M, N, PA, k_pad, strips, strip_size, m, s, n_begin, C);
      else
        amx_tiles<1, 1>(M, N, PA, k_pad, strips, strip_size, m, s, n_begin, C);
    }
  }
  _tile_release();
}

}  // namespace

#endif
