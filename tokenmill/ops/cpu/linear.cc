// A linear layer on CPU, called from JAX through the XLA FFI (target "tokenmill_linear");
// tokenmill/ops/cpu/linear.py is its Python side.
//
//   y[M, N] = x[M, K] . w[layer]      for w the [L, K, N] stack of every layer's weights
//
// The weights may come in the kernel's own layout instead, [L, N / kStrip, K, kStrip] (strips of
// kStrip columns, made once at load time by linear.py's `to_strips`; 8-bit scales stay row-major):
// the GEMM then multiplies float32 ones where they lie instead of packing a copy of every panel on
// every call, and a GEMV reads each strip as one contiguous stream instead of a few bytes of every
// row of B.
//
// The layer is an operand, not a slice: inside the model's scan over layers, a custom call given
// one layer's slice would make XLA copy it out of the stack first, i.e. read the weights twice.
// Weights are float32, or 8-bit (int8, float8 e4m3fn / e5m2) with one float32 scale per window of
// `wsz` rows and column (scale [L, K / wsz, N]), dequantized as they are packed (gemm.h): decoding a
// batch of one reads a quarter of the bytes of float32. Or 4-bit codes (GGUF's Q4_0 / Q4_1 blocks,
// kept as they are), in strips only ([L, N / 32, K, 16] bytes), with a scale and an offset per
// window and column: value = code * scale + offset.
//
// The columns are cut into blocks (about four per thread) that the calling thread and its helpers
// claim (parallel.h: for the GEMV's short calls, helpers that spin between calls). Up to kGemvRows
// rows (decoding) each block streams its weights straight through gemv; more rows pack A once and
// run gemm.h's blocked GEMM over each block, each thread claiming its next block ahead and
// prefetching that block's first weights. From kRowChunkRows rows a thread on (prefills), the rows
// are cut into chunks instead, each packed and multiplied by all of B. The layer index
// follows jnp indexing: negative wraps once, then it is clamped into range.
//
// `gated` (a gated MLP's fused gate/up projection, [K, 2I]): y [M, I] = silu(x . gate) * (x . up). Where
// the float32 GEMM splits a prefill's rows, it activates each kNC gate columns and their up columns
// while they are in L2 (silu.h), so that the [M, 2I] product never goes to memory; the integer dot
// products (w8a16_int, gguf_int) activate each tile of a gate strip and its up strip as it is made
// (int8_dot.h's dot_tiles), at every M; elsewhere the whole product goes to a buffer first (GatedByParts).
//
// `bf16` (--quantization w8a16): x is rounded to bfloat16 (ties to even) and multiplies the 8-bit
// weights. 1: on the float32 path; 2: with the CPU's bfloat16 dot products (bf16_pack.h: the codes
// are exact bfloat16, each window's sum is scaled in float32), on AMX tiles (amx_bf16.h) where this
// build and the OS allow them, else with AVX512-BF16 (avx512_bf16.h), for every M (one arithmetic
// whatever the batch); as 1 where the build has neither or the scale windows do not fit.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "parallel.h"
#include "weights_ffi.h"
#include "gemm.h"
#include "amx_bf16.h"
#include "avx512_bf16.h"
#include "int8_dot.h"
#include "silu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// x rounded to the nearest bfloat16, ties to even (finite x), kept in float32
float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

int64_t wrap_clamp(int64_t i, int64_t n) {
  if (i < 0) i += n;
  return std::min<int64_t>(std::max<int64_t>(i, 0), n - 1);
}

// 4-bit codes as Weights (w: uint8, two codes per byte, in strips); "" when usable, else what is wrong
const char* uint4_weights(const ffi::AnyBuffer& w, const ffi::Buffer<ffi::F32>& scale,
                          const ffi::Buffer<ffi::F32>& offset, int64_t wsz, int64_t K, int64_t N, int64_t bf16,
                          Weights& all) {
  if (wsz <= 0 || K % wsz != 0) return "4-bit weights need a window size that divides the reduction axis";
  const size_t windows = w.element_count() * 2 / size_t(wsz);
  if (scale.element_count() != windows || offset.element_count() != windows)
    return "4-bit weights need one scale and one offset per window";
  if (bf16 != 0) return "bf16 multiplies 8-bit weights only";
  all.data = static_cast<const char*>(w.untyped_data());
  all.N = N;
  all.elem = 1;
  all.is_uint4 = true;
  all.scale = scale.typed_data();
  all.offset = offset.typed_data();
  all.wsz = wsz;
  return "";
}

// Whether waking a helper thread costs more than it saves: decoding, below this many bytes of weights;
// else below this many multiply-adds (by bytes, SmolLM2's int8 o projection, 576 x 576, ran on one
// thread at every batch: w8a16 at 2048 rows 199 GFLOP/s, against 370 with both threads)
bool runs_alone(int64_t M, int64_t K, int64_t N, int64_t weight_bytes) {
  return M <= kGemvRows ? weight_bytes < (int64_t(1) << 19) : M * K * N < (int64_t(1) << 22);
}

// One packed panel of B per thread, kept across calls (a fresh 256 KiB buffer costs page faults)
float* thread_panel() {
  thread_local std::vector<float> panel(kKC * round_up(kNC, kNR));
  return panel.data();
}

// A of at least this many floats is packed by all the call's threads; a decode step's (64 rows of
// SmolLM2's 576: 36864 floats) stays below, packed by the calling thread as before
constexpr int64_t kParallelPackFloats = int64_t(1) << 16;

// From this many rows per thread on, the GEMM's threads split the rows instead of the columns, into
// kRowChunks chunks per thread (a late helper leaves at most one chunk to the others)
constexpr int64_t kRowChunkRows = 512;
constexpr int64_t kRowChunks = 4;

// --quantization w8a16_int / gguf_int (int8_dot.h): x quantized to 16-bit integers per window, times
// int8 weights in quad strips [L, N / 32, K / 4, 32, 4] (codes + 128), or 4-bit codes in nibble quad
// strips [L, N / 32, K / 8, 32, 4] (with offsets), with integer dot products; `gated`: y [M, N / 2] =
// silu(x . gate) * (x . up), activated strip by strip (int8_dot.h's dot_tiles; N / 2 whole strips)
ffi::Error LinearIntDot(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const ffi::AnyBuffer& w,
                        const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>& offset, int64_t layer,
                        float* y, int64_t wsz, bool gated) {
  auto wd = w.dimensions();
  const int64_t L = wd[0], N = wd[1] * kStrip, out_columns = gated ? N / 2 : N;
  IntWeights B;
  B.nibbles = offset.element_count() != 0;
  B.K = K;
  B.N = N;
  B.wsz = wsz;
  if (wsz <= 0 || wsz % B.k_per_row() != 0 || wsz > kMaxIntWindow || K % wsz != 0)
    return ffi::Error::InvalidArgument(
        "linear: integer dot products need a window size that is a multiple of 4 (4-bit codes: 8), at most 512, "
        "and divides K");
  const size_t scales = size_t(L * (K / wsz) * N);
  if (scale.element_count() != scales || (B.nibbles && offset.element_count() != scales))
    return ffi::Error::InvalidArgument("linear: integer dot products need one scale (and offset) per window and column");
  const int64_t l = wrap_clamp(layer, L);
  B.data = static_cast<const uint8_t*>(w.untyped_data()) + l * (K / B.k_per_row()) * (N / kStrip) * kQuadRowBytes;
  B.scale = scale.typed_data() + l * (K / wsz) * N;
  if (B.nibbles) B.offset = offset.typed_data() + l * (K / wsz) * N;
  if (M == 0 || N == 0) return ffi::Error::Success();
  thread_local QuantizedRows kept;  // kept across calls, like the other paths' packed A
  QuantizedRows& rows = kept;  // (inside the lambdas, `kept` would be each worker's own)
  rows.resize(M, K, wsz);
  const bool alone = runs_alone(M, K, N, K * N / (B.nibbles ? 2 : 1));
  const int64_t threads = alone ? 1 : std::max<int64_t>(1, pool.num_threads());
  struct NoState {};
  auto make = [] { return std::make_unique<NoState>(); };
  // x's rows are quantized by every thread, as the call's first items (a prefill's in 4 chunks a thread,
  // a decode step's in one), and the blocks of dot products follow: a thread that claims a block waits
  // for the chunks still being quantized, all claimed before it by threads that run. Quantized apart by
  // the calling thread, a decode step's 64 rows left the helper idle meanwhile (3% of the step); a
  // prefill's took a parallel call of their own. A GEMV's rows are too few to share.
  const int64_t chunks = threads > 1 && M > kGemvRows ? (M >= kMC * threads ? 4 : 1) * threads : 0;
  if (chunks == 0) quantize_rows(K, wsz, x, rows, 0, M);
  std::atomic<int64_t> quantized{0};
  // blocks of whole strips, a few per thread so that a late helper leaves little to the others; when
  // decoding, two long ones, which the hardware's prefetchers stream better than many short ones
  // (SmolLM2's W2 decode, 3 rounds: 24 blocks a thread 137-143 tok/s, 2 blocks 149-169)
  const int64_t per_thread = M <= kGemvRows ? 2 : 4;
  const int64_t block = round_up(
      std::max<int64_t>(kStrip, (out_columns + per_thread * threads - 1) / (per_thread * threads)), kStrip);
  const int64_t blocks = (out_columns + block - 1) / block;
  auto run = [&](int64_t i, NoState&) {
    if (i < chunks) {
      quantize_rows(K, wsz, x, rows, M * i / chunks, M * (i + 1) / chunks);
      quantized.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; quantized.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 64)
        cpu_relax();
      else
        std::this_thread::yield();
    }
    const int64_t n0 = (i - chunks) * block;
    dot_gemm(M, B, rows, y, n0, std::min(out_columns, n0 + block), gated);
  };
  if (alone) {
    NoState none;
    for (int64_t i = 0; i < blocks; ++i) run(i, none);
  } else {
    parallel_for<NoState>(pool, chunks + blocks, make, run, /*spin=*/M <= kGemvRows);
  }
  return ffi::Error::Success();
}

// What the kernel applies to a fused gate/up product [M, 2I] (attribute `gated`): y [M, I] = act(gate) * up
enum Gated : int64_t { kNotGated = 0, kSiluGated = 1 };

// out[rows of tiles t_begin..t_end, :] = silu(A . B[:, :H]) * (A . B[:, H:]) for H = N / 2 (A packed by
// pack_a): kNC gate columns and their up columns at a time, into a buffer that stays in L2 for the
// activation, so that the [M, N] product never goes out to memory and back
static void silu_gated_gemm(int64_t M, int64_t N, int64_t K, const float* pa, const Weights& B, float* out,
                            int64_t t_begin, int64_t t_end) {
  const int64_t H = N / 2, ld = 2 * kNC;
  thread_local std::vector<float> product;  // [M, ld], this call's rows only (kept across calls)
  product.resize(M * ld);
  const RowTiles tiles(M);
  const int64_t r0 = tiles.start(t_begin), r1 = tiles.start(t_end);
  for (int64_t n0 = 0; n0 < H; n0 += kNC) {
    const int64_t nc = std::min(kNC, H - n0);
    const Weights gate = B.columns_from(n0), up = B.columns_from(H + n0);
    const Weights next_gate = n0 + kNC < H ? B.columns_from(n0 + kNC) : gate;
    const NextBlock after_gate{&up, 0, nc, K};
    const NextBlock after_up = n0 + kNC < H ? NextBlock{&next_gate, 0, std::min(kNC, H - n0 - kNC), K} : NextBlock{};
    gemm_packed(M, ld, K, pa, gate, product.data(), thread_panel(), 0, nc, after_gate, t_begin, t_end);
    gemm_packed(M, ld, K, pa, up, product.data() + kNC, thread_panel(), 0, nc, after_up, t_begin, t_end);
    silu_gate(product.data() + r0 * ld, ld, kNC, r1 - r0, nc, out + r0 * H + n0, H);
  }
}

ffi::Error GatedByParts(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w,
                        ffi::Buffer<ffi::F32>& scale, ffi::Buffer<ffi::F32>& offset, ffi::Buffer<ffi::S32>& layer,
                        float* out, int64_t M, int64_t N, int64_t wsz, int64_t bf16);

// out's first M rows = x's first M rows . w[layer] (out [x's rows, N], `out_count` floats), or with
// `gated`, act(its first N / 2 columns) * its other N / 2 (out [x's rows, N / 2])
ffi::Error LinearRows(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w, ffi::Buffer<ffi::F32>& scale,
                      ffi::Buffer<ffi::F32>& offset, ffi::Buffer<ffi::S32>& layer, float* out, size_t out_count,
                      int64_t M, int64_t wsz, int64_t bf16, int64_t gated) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const bool quads = w.element_type() == ffi::DataType::U8 && wd.size() == 5;  // integer dot products
  const bool uint4 = !quads && w.element_type() == ffi::DataType::U8;
  const bool strips = wd.size() == 4;
  if (quads) {
    const int64_t row_k = offset.element_count() != 0 ? 2 * kQuad : kQuad;
    if (xd.size() != 2 || wd[2] * row_k != xd[1] || wd[3] != kStrip || wd[4] != kQuad || wd[0] <= 0)
      return ffi::Error::InvalidArgument(
          "linear: expected x [M, K] and int8 quads [L, N / 32, K / 4, 32, 4] or 4-bit ones [L, N / 32, K / 8, 32, 4]");
    if (bf16 != 0) return ffi::Error::InvalidArgument("linear: quad strips take no bf16");
  } else {
    const int64_t row = uint4 ? kStrip / 2 : kStrip;  // stored elements per row of a strip
    if (xd.size() != 2 ||
        !((wd.size() == 3 && !uint4 && wd[1] == xd[1]) || (strips && wd[2] == xd[1] && wd[3] == row)))
      return ffi::Error::InvalidArgument(
          "linear: expected x [M, K] and w [L, K, N], its strips [L, N / 32, K, 32] or 4-bit strips [L, N / 32, K, 16]");
  }
  const int64_t K = xd[1], L = wd[0], N = quads || strips ? wd[1] * kStrip : wd[2];
  if (L <= 0 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("linear: expected a scalar layer");
  if (gated != kNotGated && (gated != kSiluGated || N % 2 != 0))
    return ffi::Error::InvalidArgument("linear: gated takes 1 (silu) and an even N");
  if (out_count != size_t(xd[0] * (gated != kNotGated ? N / 2 : N)))
    return ffi::Error::InvalidArgument("linear: expected y [M, N] (gated: [M, N / 2])");
  if (quads) {
    if (gated != kNotGated && (N / 2) % kStrip != 0)
      return GatedByParts(pool, x, w, scale, offset, layer, out, M, N, wsz, bf16);
    return LinearIntDot(pool, x.typed_data(), M, K, w, scale, offset, layer.typed_data()[0], out, wsz,
                        gated != kNotGated);
  }
  if (!uint4 && offset.element_count() != 0)
    return ffi::Error::InvalidArgument("linear: offsets go with 4-bit weights only");
  Weights all;
  if (const char* problem = uint4 ? uint4_weights(w, scale, offset, wsz, K, N, bf16, all)
                                  : weights_of(w, scale, wsz, K, N, all);
      *problem)
    return ffi::Error::InvalidArgument(std::string("linear: ") + problem);
  if (strips) all.strip_stride = K * kStrip;
  const int64_t l = wrap_clamp(layer.typed_data()[0], L);
  const Weights weights = all.at(l * K * N, wsz > 0 ? l * (K / wsz) * N : 0);
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out, out + M * (gated != kNotGated ? N / 2 : N), 0.f);
    return ffi::Error::Success();
  }

  const bool alone = runs_alone(M, K, N, K * N * weights.elem);
  const int64_t threads = alone ? 1 : std::max<int64_t>(1, pool.num_threads());
  const bool row_chunks = M > kGemvRows && M >= kRowChunkRows * threads;  // a prefill's rows (below)
  // a gated product is activated in cache where the float32 GEMM splits rows (whole strips per half)
  if (gated != kNotGated && !(row_chunks && bf16 == 0 && (!strips || (N / 2) % kStrip == 0)))
    return GatedByParts(pool, x, w, scale, offset, layer, out, M, N, wsz, bf16);
  const bool gemv = M <= gemv_max_rows(weights);  // a float32 GEMV (below) where no bf16 path takes it
  const int64_t unit = gemv ? kGemvVectors * kVW : strips ? kStrip : kNR;  // blocks of whole strips
  // blocks per thread: a helper thread that starts late leaves at most one block to the others.
  // B in strips costs nothing to cut finely, and up to a row block of A (kMC rows) re-reading A for
  // each block is cheap; else each block's B panels are packed anew, and 4 per thread balance well.
  const int64_t per_thread = strips && M <= kMC ? 24 : 4;
  const int64_t block =
      round_up(std::max<int64_t>(unit, (N + per_thread * threads - 1) / (per_thread * threads)), unit);
  const int64_t blocks = (N + block - 1) / block;
  struct NoState {};
#if defined(TOKENMILL_BF16)
  const int64_t k_pad = round_up(K, kTileK);
  const int64_t window = weights.scale == nullptr ? 0 : bf16_window(wsz, K, k_pad);
  if (bf16 == 2 && window > 0) {
#if defined(TOKENMILL_AMX)
    const bool tiles = amx_ready();
#else
    constexpr bool tiles = false;
#endif
    // only the tiles read rows past M (a decode step's one row would be written out as 16 per call)
    const int64_t m_pad = tiles ? round_up(M, kTileRows) : M;
    // kept across calls: a fresh buffer of a prefill's size is mapped anew, and every page faulted in
    thread_local std::vector<uint16_t> packed_a;
    packed_a.resize(m_pad * k_pad);
    pack_a_bf16(M, K, x.typed_data(), packed_a.data(), m_pad, k_pad);
    const uint16_t* pa = packed_a.data();  // (inside the lambda, packed_a would be each worker's own)
    if (!tiles && M <= kGemvRows && dot_gemv_fits(weights, K)) {  // decoding: no packing of B
      if (alone) {
        dot_gemv_rows(M, K, pa, weights, window, out, 0, N);
      } else {
        parallel_for<NoState>(
            pool, blocks, [] { return std::make_unique<NoState>(); },
            [&](int64_t i, NoState&) {
              dot_gemv_rows(M, K, pa, weights, window, out, i * block, std::min(N, (i + 1) * block));
            },
            /*spin=*/true);
      }
      return ffi::Error::Success();
    }
    // blocks of whole tile pairs, at most 256 columns: a block's strips stay in L2 while A streams by
    const int64_t columns = std::min<int64_t>(256, round_up((N + 4 * threads - 1) / (4 * threads), 2 * kTileCols));
    const int64_t count = (N + columns - 1) / columns;
    auto run = [&](int64_t i, NoState&) {
      thread_local std::vector<uint16_t> strips;  // kept across calls, like gemm's panel
      strips.resize(columns * k_pad);
      const int64_t n_begin = i * columns, n_end = std::min(N, (i + 1) * columns);
#if defined(TOKENMILL_AMX)
      if (tiles) {
        amx_gemm_columns(M, N, K, pa, m_pad, k_pad, weights, window, out, strips.data(), n_begin, n_end);
        return;
      }
#endif
      dot_gemm_columns(M, N, K, pa, k_pad, weights, window, out, strips.data(), n_begin, n_end);
    };
    if (alone) {
      NoState none;
      for (int64_t i = 0; i < count; ++i) run(i, none);
    } else {
      parallel_for<NoState>(pool, count, [] { return std::make_unique<NoState>(); }, run);
    }
    return ffi::Error::Success();
  }
#endif
  const float* xp = x.typed_data();
  thread_local std::vector<float> rounded, packed_a;  // kept across calls, like the bf16 path's
  if (bf16) {  // the float32 path multiplies x's bfloat16 values
    rounded.assign(xp, xp + M * K);
    for (float& v : rounded) v = round_bf16(v);
    xp = rounded.data();
  }
  if (gemv) {
    if (alone) {
      gemv_rows(M, K, xp, weights, out, 0, N);
      return ffi::Error::Success();
    }
    parallel_for<NoState>(
        pool, blocks, [] { return std::make_unique<NoState>(); },
        [&](int64_t i, NoState&) { gemv_rows(M, K, xp, weights, out, i * block, std::min(N, (i + 1) * block)); },
        /*spin=*/true);  // decoding: a few tens of microseconds per call, one call after the other
    return ffi::Error::Success();
  }
  packed_a.resize(round_up(M, kMR) * K);
  float* pa = packed_a.data();
  if (row_chunks) {
    // a prefill: rows cut into chunks, each packed and multiplied by every column by one thread, so
    // that a thread streams only its own rows of A and meets each panel of B with all of them (cut by
    // columns, every block re-read all of A: SmolLM2's projections at 2048 rows, 2 threads, 223 ->
    // 240 GFLOP/s; its down projection, K = 1536, 190 -> 230)
    const int64_t tiles = RowTiles(M).count, chunks = kRowChunks * threads;  // (M / kMR >= chunks)
    parallel_for<NoState>(
        pool, chunks, [] { return std::make_unique<NoState>(); },
        [&](int64_t i, NoState&) {
          const int64_t t_begin = tiles * i / chunks, t_end = tiles * (i + 1) / chunks;
          pack_a(M, K, xp, pa, t_begin, t_end);
          if (gated == kSiluGated)
            silu_gated_gemm(M, N, K, pa, weights, out, t_begin, t_end);
          else
            gemm_packed(M, N, K, pa, weights, out, thread_panel(), 0, N, {}, t_begin, t_end);
        });
    return ffi::Error::Success();
  }
  if (M * K < kParallelPackFloats) {
    pack_a(M, K, xp, pa);
  } else {  // a prefill's A, packed by one thread, left the others idle (2048 rows: 247 -> 257 GFLOP/s)
    const int64_t tiles = RowTiles(M).count, per_item = 8;
    parallel_for<NoState>(
        pool, (tiles + per_item - 1) / per_item, [] { return std::make_unique<NoState>(); },
        [&](int64_t i, NoState&) { pack_a(M, K, xp, pa, i * per_item, std::min(tiles, (i + 1) * per_item)); });
  }
  parallel_for<NoState>(
      pool, blocks, [] { return std::make_unique<NoState>(); },
      [&](int64_t i, int64_t following, NoState&) {
        // the block this thread multiplies next: its first panel streams in during this block's last
        // (SmolLM2's projections at 64 rows: 197 -> 207 GFLOP/s, with panels of equal depth)
        NextBlock next;
        if (following >= 0) next = {&weights, following * block, std::min(N, (following + 1) * block), K};
        gemm_packed(M, N, K, pa, weights, out, thread_panel(), i * block, std::min(N, (i + 1) * block), next);
      });
  return ffi::Error::Success();
}

// A gated product where the GEMM cannot activate it in cache (decoding, bfloat16 inputs, 16-bit integer
// ones where I is not whole strips): the whole product [M, N] into a buffer, then y [M, N / 2] = silu(its first half) * its second
ffi::Error GatedByParts(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w,
                        ffi::Buffer<ffi::F32>& scale, ffi::Buffer<ffi::F32>& offset, ffi::Buffer<ffi::S32>& layer,
                        float* out, int64_t M, int64_t N, int64_t wsz, int64_t bf16) {
  const int64_t all_rows = x.dimensions()[0], H = N / 2;
  thread_local std::vector<float> kept;  // kept across calls, like the packed A
  std::vector<float>& product = kept;  // (inside the lambda, `kept` would be each worker's own)
  product.resize(all_rows * N);
  ffi::Error error = LinearRows(pool, x, w, scale, offset, layer, product.data(), product.size(), M, wsz, bf16,
                                kNotGated);
  if (!error.success()) return error;
  constexpr int64_t kRowsPerItem = 64;
  if (M * H < (int64_t(1) << 17) || pool.num_threads() <= 1) {  // a decode step's: not worth a helper
    silu_gate(product.data(), N, H, M, H, out, H);
    return error;
  }
  struct NoState {};
  parallel_for<NoState>(
      pool, (M + kRowsPerItem - 1) / kRowsPerItem, [] { return std::make_unique<NoState>(); },
      [&](int64_t i, NoState&) {
        const int64_t r0 = i * kRowsPerItem, rows = std::min(M, r0 + kRowsPerItem) - r0;
        silu_gate(product.data() + r0 * N, N, H, rows, H, out + r0 * H, H);
      });
  return error;
}

// Only x's first `rows` rows are multiplied; y's other rows are zeros. A step padded to its shape
// bucket (W3's prompts: 1568 tokens run as 2048) then pays for its padding with a memset only.
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                      ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t wsz, int64_t bf16, int64_t gated) {
  auto xd = x.dimensions();
  if (rows.element_count() != 1 || xd.size() != 2)
    return ffi::Error::InvalidArgument("linear: expected x [M, K] and a scalar row count");
  const int64_t all_rows = xd[0], M = std::clamp<int64_t>(rows.typed_data()[0], 0, all_rows);
  ffi::Error error =
      LinearRows(pool, x, w, scale, offset, layer, y->typed_data(), y->element_count(), M, wsz, bf16, gated);
  if (error.success() && M < all_rows) {
    const size_t N = y->element_count() / all_rows;
    std::fill(y->typed_data() + M * N, y->typed_data() + y->element_count(), 0.f);
  }
  return error;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [L, K, N] or strips: f32, s8, f8e4m3fn or f8e5m2;
                                                          // or u8: 4-bit codes in strips
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [L, K / wsz, N] ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset [L, K / wsz, N] (4-bit w; [0]: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: x's leading rows to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N] (gated: [M, N / 2])
                                  .Attr<int64_t>("wsz")  // rows per scale window (0: float32 weights)
                                  .Attr<int64_t>("bf16")  // 0: float32 x; 1, 2: x rounded to bfloat16 (2: bf16 dot products)
                                  .Attr<int64_t>("gated"));  // 0: y = x . w; 1: y [M, N / 2] = silu(first half) * second
