// The expert FFNs of a fused MoE layer on CPU, called from JAX through the XLA FFI
// (target "tokenmill_moe_experts"); tokenmill/ops/cpu/moe.py is its Python side.
//
// Given the routed (token, expert) assignments sorted by expert (sorted_token / sorted_weight, and
// group_begin[e] .. group_begin[e + 1] the rows of local expert e), every expert with rows computes
//   out[t] += w * (act(x[t] @ w1[e, 0] + b1[e, 0], x[t] @ w1[e, 1] + b1[e, 1]) @ w2[e] + b2[e])
// for each of its assignments (t, w). Experts with no row are never read. The weights are read in
// place from the stacked [E, 2, D, F] / [E, F, D] arrays: this is the point of the kernel, since
// XLA:CPU copies and re-packs an expert's slice on every dot (see ops/moe.py's docstring).
// Weights are float32, or 8-bit (int8, float8 e4m3fn / e5m2) with one float32 scale per window of
// `wsz` rows along the reduction axis: those are decoded and scaled as each panel is packed, so
// memory carries a quarter of the bytes and the arithmetic stays float32.
//
// Work items are (expert, chunk of at most kChunkRows rows). Each runs three small GEMMs with a
// register-blocked kernel (kMR rows x kNR columns of C in registers, B read in kKC-row panels that
// stay in L1 while every row block of A passes over them). Items are claimed from an atomic counter
// by the calling thread and helper tasks on XLA's intra-op pool (the scheme of paged_attention.cc);
// a token may appear in several experts, so each helper sums into its own output buffer and the
// caller adds those into `out` at the end.
//
// Built by tokenmill/ops/cpu/build.py; the inner loops use GCC vector extensions, which lower to
// AVX2/FMA (or AVX-512 where the build enables it) or to portable code.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
constexpr int64_t kKC = 256;  // rows of B per packed panel
constexpr int64_t kNC = 256;  // columns of B per packed panel (kKC x kNC floats: 256 KiB, L2-sized)
constexpr int64_t kChunkRows = 128;  // rows of one work item

enum Activation : int32_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kSwigluOai = 3 };

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

// A weight matrix B[K, N], row-major: float32, or 8-bit codes (int8, or float8 decoded through
// `table`) with one float32 scale per window of `wsz` rows and column (scale [K / wsz, N]).
struct Weights {
  const char* data = nullptr;
  int64_t N = 0;
  int elem = 4;  // bytes per value
  const float* table = nullptr;  // float8 only
  bool is_int8 = false;
  const float* scale = nullptr;  // nullptr: float32 values
  int64_t wsz = 0;

  // the sub-matrix that starts `values` values and `scales` scales further on (another expert's)
  Weights at(int64_t values, int64_t scales) const {
    Weights w = *this;
    w.data += values * elem;
    if (w.scale != nullptr) w.scale += scales;
    return w;
  }
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
  // rows [k0, k0 + rows) x columns [n0, n0 + cols) of B (its scales are few: left to the hardware)
  Prefetch(const Weights& B, int64_t k0, int64_t n0, int64_t rows, int64_t cols)
      : row(B.data + (k0 * B.N + n0) * B.elem),
        stride(B.N * B.elem),
        row_lines((cols * B.elem + 63) / 64),
        rows_left(rows) {}

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

// C[0:M, 0:cols] = (accumulate ? C : 0) + A[0:M, 0:kc] . B[0:kc, 0:kNR], from packed operands: PA
// holds A k-major (kMR floats per k, rows past M unused), PB one strip of B (kNR floats per k,
// zero past `cols`).
template <int M>
static void micro_kernel(int64_t kc, const float* PA, const float* PB, float* C, int64_t ldc, int cols,
                         bool accumulate, Prefetch& pf) {
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
    for (int j = 0; j < kNV; ++j) b[j] = loadv(PB + k * kNR + j * kVW);
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
}

using MicroKernel = void (*)(int64_t, const float*, const float*, float*, int64_t, int, bool, Prefetch&);

template <int... Ms>
constexpr auto micro_table(std::integer_sequence<int, Ms...>) {
  return std::array<MicroKernel, sizeof...(Ms)>{&micro_kernel<Ms + 1>...};
}
constexpr auto kMicroKernels = micro_table(std::make_integer_sequence<int, kMR>{});  // [m - 1]: m rows

TM_INLINE int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// A[M, K] (row-major) → for each block of kKC columns k0 and each block of kMR rows, a kc x kMR
// k-major tile at PA + k0 * round_up(M, kMR) + (m0 / kMR) * kc * kMR
static void pack_a(int64_t M, int64_t K, const float* A, float* PA) {
  const int64_t m_pad = round_up(M, kMR);
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      float* tile = PA + k0 * m_pad + (m0 / kMR) * kc * kMR;
      const int64_t m = std::min<int64_t>(kMR, M - m0);
      for (int64_t i = 0; i < m; ++i) {
        const float* row = A + (m0 + i) * K + k0;
        for (int64_t k = 0; k < kc; ++k) tile[k * kMR + i] = row[k];
      }
    }
  }
}

// B[k0:k0+kc, n0:n0+nc] → strips of kNR columns, each kc x kNR contiguous float32, zero-padded;
// 8-bit values are decoded and scaled here, one panel at a time
static void pack_b(int64_t kc, int64_t nc, const Weights& B, int64_t k0, int64_t n0, float* PB) {
  const int64_t strips = (nc + kNR - 1) / kNR;
  for (int64_t k = 0; k < kc; ++k) {
    const char* row = B.data + ((k0 + k) * B.N + n0) * B.elem;
    const float* scale = B.scale == nullptr ? nullptr : B.scale + ((k0 + k) / B.wsz) * B.N + n0;
    for (int64_t s = 0; s < strips; ++s) {
      float* dst = PB + (s * kc + k) * kNR;
      const int64_t first = s * kNR, n = std::min<int64_t>(kNR, nc - first);
      if (scale == nullptr) {
        std::memcpy(dst, row + first * 4, n * sizeof(float));
      } else if (B.is_int8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(row) + first;
        for (int64_t j = 0; j < n; ++j) dst[j] = float(q[j]) * scale[first + j];
      } else {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(row) + first;
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

// C[M, N] = A[M, K] . B[K, N], all row-major (leading dimensions K, N, N). `next`, when given, is
// the B of the GEMM that follows: its first panel is prefetched during the last panel of this one.
static void gemm(int64_t M, int64_t N, int64_t K, const float* A, const Weights& B, float* C, GemmBuffers& buf,
                 const Weights* next = nullptr) {
  pack_a(M, K, A, buf.a.data());
  const int64_t m_pad = round_up(M, kMR);
  for (int64_t n0 = 0; n0 < N; n0 += kNC) {
    const int64_t nc = std::min(kNC, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      const int64_t kc = std::min(kKC, K - k0);
      pack_b(kc, nc, B, k0, n0, buf.b.data());
      Prefetch pf;
      if (k0 + kKC < K)
        pf = Prefetch(B, k0 + kKC, n0, std::min(kKC, K - k0 - kKC), nc);
      else if (n0 + kNC < N)
        pf = Prefetch(B, 0, n0 + kNC, std::min(kKC, K), std::min(kNC, N - n0 - kNC));
      else if (next != nullptr)
        pf = Prefetch(*next, 0, 0, kKC, std::min(kNC, next->N));
      for (int64_t s = 0; s * kNR < nc; ++s) {
        const int cols = int(std::min<int64_t>(kNR, nc - s * kNR));
        for (int64_t m0 = 0; m0 < M; m0 += kMR) {
          const int m = int(std::min<int64_t>(kMR, M - m0));
          kMicroKernels[m - 1](kc, buf.a.data() + k0 * m_pad + (m0 / kMR) * kc * kMR, buf.b.data() + s * kc * kNR,
                               C + m0 * N + n0 + s * kNR, N, cols, k0 > 0, pf);
        }
      }
    }
  }
}

TM_INLINE float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

TM_INLINE float gated(float g, float u, int32_t act, float alpha, float limit) {
  switch (act) {
    case kSilu:
      return g * sigmoid(g) * u;
    case kGelu:
      return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f)) * u;
    case kGeluTanh:
      return 0.5f * g * (1.f + std::tanh(0.79788456080286536f * (g + 0.044715f * g * g * g))) * u;
    default: {  // swigluoai (gpt-oss): clamped gate and up
      g = std::min(g, limit);
      u = std::min(std::max(u, -limit), limit);
      return g * sigmoid(alpha * g) * (u + 1.f);
    }
  }
}

struct Problem {
  int64_t T = 0, D = 0, F = 0, E = 0;
  const float* x = nullptr;  // [T, D]
  Weights w1;  // [E, 2, D, F] (scales [E, 2, D / wsz, F])
  Weights w2;  // [E, F, D] (scales [E, F / wsz, D])
  const float* b1 = nullptr;  // [E, 2, F]
  const float* b2 = nullptr;  // [E, D]
  const int32_t* sorted_token = nullptr;  // [A]
  const float* sorted_weight = nullptr;  // [A]
  const int32_t* group_begin = nullptr;  // [E + 1]
  int32_t act = kSilu;
  float alpha = 0.f, limit = 0.f;
  std::vector<int64_t> item_expert, item_row;  // per work item: its expert and first sorted row
};

struct Scratch {
  std::vector<float> x, gate, up, y;
  GemmBuffers gemm;
  explicit Scratch(const Problem& pb)
      : x(kChunkRows * pb.D),
        gate(kChunkRows * pb.F),
        up(kChunkRows * pb.F),
        y(kChunkRows * pb.D),
        gemm(kChunkRows, std::max(pb.D, pb.F)) {}
};

static void run_item(const Problem& pb, int64_t item, Scratch& s, float* out) {
  const int64_t e = pb.item_expert[item], r0 = pb.item_row[item];
  const int64_t n = std::min<int64_t>(kChunkRows, pb.group_begin[e + 1] - r0);
  const int64_t D = pb.D, F = pb.F;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = std::min<int64_t>(std::max<int32_t>(pb.sorted_token[r0 + i], 0), pb.T - 1);
    std::memcpy(s.x.data() + i * D, pb.x + t * D, D * sizeof(float));
  }
  const int64_t wsz = std::max<int64_t>(pb.w1.wsz, 1);
  const Weights gate = pb.w1.at(e * 2 * D * F, e * 2 * (D / wsz) * F);
  const Weights up = gate.at(D * F, (D / wsz) * F);
  const Weights down = pb.w2.at(e * F * D, e * (F / wsz) * D);
  gemm(n, F, D, s.x.data(), gate, s.gate.data(), s.gemm, &up);
  gemm(n, F, D, s.x.data(), up, s.up.data(), s.gemm, &down);
  const float* bg = pb.b1 + e * 2 * F;
  const float* bu = bg + F;
  for (int64_t i = 0; i < n; ++i) {
    float* g = s.gate.data() + i * F;
    const float* u = s.up.data() + i * F;
    for (int64_t f = 0; f < F; ++f) g[f] = gated(g[f] + bg[f], u[f] + bu[f], pb.act, pb.alpha, pb.limit);
  }
  gemm(n, D, F, s.gate.data(), down, s.y.data(), s.gemm);
  const float* b2 = pb.b2 + e * D;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = pb.sorted_token[r0 + i];
    if (t < 0 || t >= pb.T) continue;  // not a local assignment
    const float w = pb.sorted_weight[r0 + i];
    float* o = out + int64_t(t) * D;
    const float* y = s.y.data() + i * D;
    for (int64_t d = 0; d < D; ++d) o[d] += w * (y[d] + b2[d]);
  }
}

// The claiming scheme of paged_attention.cc: the caller waits only for claimed items, so a helper
// that never gets a thread cannot block it; late helpers touch only this reference-counted block.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<std::vector<float>>> helper_out;  // guarded by mu
};

static void work(Shared& sh, const Problem* pb, float* caller_out) {
  std::unique_ptr<Scratch> scratch;
  float* out = caller_out;
  int64_t mine = 0;
  for (;;) {
    const int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= sh.total) break;
    if (!scratch) {
      scratch = std::make_unique<Scratch>(*pb);
      if (out == nullptr) {
        auto buf = std::make_unique<std::vector<float>>(pb->T * pb->D, 0.f);
        out = buf->data();
        std::lock_guard<std::mutex> lock(sh.mu);
        sh.helper_out.push_back(std::move(buf));
      }
    }
    run_item(*pb, i, *scratch, out);
    ++mine;
  }
  if (mine > 0 && sh.done.fetch_add(mine, std::memory_order_acq_rel) + mine == sh.total) {
    { std::lock_guard<std::mutex> lock(sh.mu); }
    sh.cv.notify_all();
  }
}

static void run(ffi::ThreadPool& pool, const Problem& pb, float* out) {
  std::fill(out, out + pb.T * pb.D, 0.f);
  const int64_t items = int64_t(pb.item_expert.size());
  if (items == 0) return;
  auto sh = std::make_shared<Shared>();
  sh->total = items;
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), items);
  for (int64_t i = 1; i < threads; ++i) {
    const Problem* pb_ptr = &pb;
    pool.Schedule([sh, pb_ptr]() { work(*sh, pb_ptr, nullptr); });
  }
  work(*sh, &pb, out);
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done.load(std::memory_order_acquire) == items; });
  for (const auto& buf : sh->helper_out) {
    const float* h = buf->data();
    for (int64_t j = 0; j < pb.T * pb.D; ++j) out[j] += h[j];
  }
}

// The weights of `buf` (expert-stacked, reduction axis `reduction_dim` of `dims`) as Weights; an
// empty string when they are usable, else what is wrong.
static const char* weights_of(const ffi::AnyBuffer& buf, const ffi::Buffer<ffi::F32>& scale, int64_t wsz,
                              int64_t reduction, int64_t N, Weights& w) {
  w.data = static_cast<const char*>(buf.untyped_data());
  w.N = N;
  switch (buf.element_type()) {
    case ffi::DataType::F32:
      w.elem = 4;
      return wsz == 0 ? "" : "float32 weights take no scales";
    case ffi::DataType::S8:
      w.is_int8 = true;
      break;
    case ffi::DataType::F8E4M3FN:
      w.table = kE4M3.data();
      break;
    case ffi::DataType::F8E5M2:
      w.table = kE5M2.data();
      break;
    default:
      return "weights must be float32, int8, float8_e4m3fn or float8_e5m2";
  }
  w.elem = 1;
  if (wsz <= 0 || reduction % wsz != 0) return "8-bit weights need a window size that divides the reduction axis";
  if (scale.element_count() * size_t(wsz) != buf.element_count()) return "scales must have one value per window";
  w.scale = scale.typed_data();
  w.wsz = wsz;
  return "";
}

ffi::Error MoeExpertsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w1, ffi::AnyBuffer w2,
                          ffi::Buffer<ffi::F32> w1_scale, ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> b1,
                          ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::S32> sorted_token,
                          ffi::Buffer<ffi::F32> sorted_weight, ffi::Buffer<ffi::S32> group_begin,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t act, float alpha, float limit, int64_t wsz) {
  auto xd = x.dimensions();
  auto w1d = w1.dimensions();
  if (xd.size() != 2 || w1d.size() != 4 || w1d[1] != 2 || w1d[2] != xd[1])
    return ffi::Error::InvalidArgument("moe_experts: expected x [T, D] and w1 [E, 2, D, F]");
  Problem pb;
  pb.T = xd[0], pb.D = xd[1], pb.E = w1d[0], pb.F = w1d[3];
  auto w2d = w2.dimensions();
  if (w2d.size() != 3 || w2d[0] != pb.E || w2d[1] != pb.F || w2d[2] != pb.D)
    return ffi::Error::InvalidArgument("moe_experts: w2 must be [E, F, D]");
  for (const char* problem : {weights_of(w1, w1_scale, wsz, pb.D, pb.F, pb.w1),
                              weights_of(w2, w2_scale, wsz, pb.F, pb.D, pb.w2)})
    if (*problem) return ffi::Error::InvalidArgument(std::string("moe_experts: ") + problem);
  if (b1.element_count() != size_t(pb.E * 2 * pb.F) || b2.element_count() != size_t(pb.E * pb.D))
    return ffi::Error::InvalidArgument("moe_experts: b1 must be [E, 2, F] and b2 [E, D]");
  if (sorted_token.element_count() != sorted_weight.element_count() ||
      group_begin.element_count() != size_t(pb.E + 1))
    return ffi::Error::InvalidArgument("moe_experts: bad assignment metadata shapes");
  if (out->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("moe_experts: out must be [T, D]");
  if (act < kSilu || act > kSwigluOai) return ffi::Error::InvalidArgument("moe_experts: unknown activation");
  pb.x = x.typed_data();
  pb.b1 = b1.typed_data(), pb.b2 = b2.typed_data();
  pb.sorted_token = sorted_token.typed_data(), pb.sorted_weight = sorted_weight.typed_data();
  pb.group_begin = group_begin.typed_data();
  pb.act = act, pb.alpha = alpha, pb.limit = limit;
  const int64_t A = int64_t(sorted_token.element_count());
  for (int64_t e = 0; e < pb.E; ++e) {
    const int64_t begin = pb.group_begin[e], end = pb.group_begin[e + 1];
    if (begin < 0 || end < begin || end > A)
      return ffi::Error::InvalidArgument("moe_experts: group_begin must be non-decreasing within [0, A]");
    for (int64_t r = begin; r < end; r += kChunkRows) {
      pb.item_expert.push_back(e);
      pb.item_row.push_back(r);
    }
  }
  run(pool, pb, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillMoeExperts, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::AnyBuffer>()  // w1 [E, 2, D, F]: f32, s8, f8e4m3fn or f8e5m2
                                  .Arg<ffi::AnyBuffer>()  // w2 [E, F, D]: likewise
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w1_scale [E, 2, D / wsz, F] ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w2_scale [E, F / wsz, D] ([0]: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b1 [E, 2, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b2 [E, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sorted_token [A]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sorted_weight [A]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_begin [E + 1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, D]
                                  .Attr<int32_t>("act")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<int64_t>("wsz"));  // rows per scale window (0: float32 weights)
