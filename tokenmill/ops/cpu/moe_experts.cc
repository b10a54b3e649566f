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
// Work items are (expert, chunk of at most kChunkRows rows). Each runs three small matmuls (gemm.h:
// packed panels, register blocking, the next panel prefetched; a GEMV for decode-sized groups). Items are spread over XLA's
// intra-op pool (parallel.h) and write each assignment's expert output to its own row. Then the
// rows are added into `out` in their sorted order, i.e. each token's experts in ascending order,
// whichever thread computed them: the result is the same on every call, and a token's result does
// not depend on the other tokens of the batch (each row's matmuls run the same FMA chain at any M).
//
// Built by tokenmill/ops/cpu/build.py; the inner loops use GCC vector extensions, which lower to
// AVX2/FMA (or AVX-512 where the build enables it) or to portable code.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gemm.h"
#include "parallel.h"
#include "weights_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkRows = 128;  // rows of one work item

enum Activation : int32_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kSwigluOai = 3 };

typedef int32_t vi __attribute__((vector_size(kVW * sizeof(int32_t))));

// e^x for every lane: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree 6
// (relative error ~1e-7, a float32 ulp or two), times 2^n built in the exponent bits. Lanes are
// clamped to [-87, 88], where 2^n stays a normal float: e^x saturates at ~1.6e38 and ~1.6e-38.
TM_INLINE vf exp_lanes(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const vf round = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (x * splat(1.44269504088896341f) + round) - round;
  const vf r = (x - n * splat(0.693145751953125f)) - n * splat(1.42860682030941723e-6f);  // ln2, hi + lo
  vf p = splat(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = p * r + splat(c);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

TM_INLINE vf sigmoid_lanes(vf x) { return splat(1.f) / (splat(1.f) + exp_lanes(-x)); }

TM_INLINE vf min_lanes(vf a, vf b) { return a < b ? a : b; }
TM_INLINE vf max_lanes(vf a, vf b) { return a > b ? a : b; }

// act(gate, up) for kVW lanes; the exact (erf) GELU has no vector form here and goes lane by lane
template <int32_t Act>
TM_INLINE vf gated(vf g, vf u, float alpha, float limit) {
  if constexpr (Act == kSilu) {
    return g * sigmoid_lanes(g) * u;
  } else if constexpr (Act == kGelu) {
    float lanes[kVW];
    std::memcpy(lanes, &g, sizeof(lanes));
    for (float& v : lanes) v = 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    return loadv(lanes) * u;
  } else if constexpr (Act == kGeluTanh) {  // 0.5 (1 + tanh y) = sigmoid(2y)
    return g * sigmoid_lanes(splat(2.f * 0.79788456080286536f) * (g + splat(0.044715f) * g * g * g)) * u;
  } else {  // swigluoai (gpt-oss): clamped gate and up
    g = min_lanes(g, splat(limit));
    u = max_lanes(min_lanes(u, splat(limit)), splat(-limit));
    return g * sigmoid_lanes(splat(alpha) * g) * (u + splat(1.f));
  }
}

// gate[i, :] = act(gate[i, :] + bg, up[i, :] + bu) for n rows of F values; a row's last partial
// vector is computed in a zero-padded copy
template <int32_t Act>
static void gate_rows(int64_t n, int64_t F, float* gate, const float* up, const float* bg, const float* bu, float alpha,
                      float limit) {
  for (int64_t i = 0; i < n; ++i) {
    float* g = gate + i * F;
    const float* u = up + i * F;
    int64_t f = 0;
    for (; f + kVW <= F; f += kVW)
      storev(g + f, gated<Act>(loadv(g + f) + loadv(bg + f), loadv(u + f) + loadv(bu + f), alpha, limit));
    if (f < F) {
      float gl[kVW] = {}, ul[kVW] = {}, bgl[kVW] = {}, bul[kVW] = {};
      const size_t bytes = (F - f) * sizeof(float);
      std::memcpy(gl, g + f, bytes), std::memcpy(ul, u + f, bytes);
      std::memcpy(bgl, bg + f, bytes), std::memcpy(bul, bu + f, bytes);
      storev(gl, gated<Act>(loadv(gl) + loadv(bgl), loadv(ul) + loadv(bul), alpha, limit));
      std::memcpy(g + f, gl, bytes);
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

// One thread's working space.
struct Scratch {
  std::vector<float> x, gate, up;
  GemmBuffers gemm;
  explicit Scratch(const Problem& pb)
      : x(kChunkRows * pb.D), gate(kChunkRows * pb.F), up(kChunkRows * pb.F), gemm(kChunkRows, std::max(pb.D, pb.F)) {}
};

// The expert outputs of one work item's rows, into rows [r0, r0 + n) of `rows` ([A, D])
static void run_item(const Problem& pb, int64_t item, Scratch& s, float* rows) {
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
  matmul(n, F, D, s.x.data(), gate, s.gate.data(), s.gemm, {&up, 0, F, D});
  matmul(n, F, D, s.x.data(), up, s.up.data(), s.gemm, {&down, 0, D, F});
  const float* bg = pb.b1 + e * 2 * F;
  const float* bu = bg + F;
  const auto gate_rows_of = pb.act == kSilu       ? gate_rows<kSilu>
                           : pb.act == kGelu     ? gate_rows<kGelu>
                           : pb.act == kGeluTanh ? gate_rows<kGeluTanh>
                                                 : gate_rows<kSwigluOai>;
  gate_rows_of(n, F, s.gate.data(), s.up.data(), bg, bu, pb.alpha, pb.limit);
  matmul(n, D, F, s.gate.data(), down, rows + r0 * D, s.gemm);
}

// out[t] = sum over t's rows r, in sorted order, of weight[r] * (rows[r] + b2[expert of r]), for the
// columns [d0, d1)
static void combine(const Problem& pb, const float* rows, float* out, int64_t d0, int64_t d1) {
  const int64_t D = pb.D;
  for (int64_t t = 0; t < pb.T; ++t) std::fill(out + t * D + d0, out + t * D + d1, 0.f);
  for (int64_t e = 0; e < pb.E; ++e) {
    const float* b2 = pb.b2 + e * D;
    for (int64_t r = pb.group_begin[e]; r < pb.group_begin[e + 1]; ++r) {
      const int32_t t = pb.sorted_token[r];
      if (t < 0 || t >= pb.T) continue;  // not a local assignment
      const float w = pb.sorted_weight[r];
      float* o = out + int64_t(t) * D;
      const float* y = rows + r * D;
      for (int64_t d = d0; d < d1; ++d) o[d] += w * (y[d] + b2[d]);
    }
  }
}

static void run(ffi::ThreadPool& pool, const Problem& pb, float* out) {
  // every sorted row's expert output, kept across calls (a fresh buffer of this size costs page faults)
  thread_local std::vector<float> kept_rows;
  kept_rows.resize(std::max<int64_t>(1, pb.group_begin[pb.E]) * pb.D);
  float* rows = kept_rows.data();  // (inside the lambdas, kept_rows would be each worker's own)
  struct NoState {};
  parallel_for<Scratch>(
      pool, int64_t(pb.item_expert.size()), [&pb] { return std::make_unique<Scratch>(pb); },
      [&pb, rows](int64_t item, Scratch& s) { run_item(pb, item, s, rows); });
  constexpr int64_t kColumns = 256;  // columns of `out` per combine item
  parallel_for<NoState>(
      pool, (pb.D + kColumns - 1) / kColumns, [] { return std::make_unique<NoState>(); },
      [&pb, rows, out](int64_t i, NoState&) { combine(pb, rows, out, i * kColumns, std::min(pb.D, (i + 1) * kColumns)); });
}

ffi::Error MoeExpertsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w1, ffi::AnyBuffer w2,
                          ffi::Buffer<ffi::F32> w1_scale, ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> b1,
                          ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::S32> sorted_token,
                          ffi::Buffer<ffi::F32> sorted_weight, ffi::Buffer<ffi::S32> group_begin,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t act, float alpha, float limit, int64_t wsz) {
  auto xd = x.dimensions();
  auto w1d = w1.dimensions();
  auto w2d = w2.dimensions();
  // float32 experts may come in strips (linear.cc's layout): w1 [E, 2, F / 32, D, 32], w2 [E, D / 32, F, 32]
  const bool strips = w1d.size() == 5;
  if (xd.size() != 2 || xd[1] != (strips ? w1d[3] : w1d.size() == 4 ? w1d[2] : -1) || w1d[1] != 2 ||
      (strips && w1d[4] != kStrip))
    return ffi::Error::InvalidArgument("moe_experts: expected x [T, D] and w1 [E, 2, D, F] or [E, 2, F / 32, D, 32]");
  Problem pb;
  pb.T = xd[0], pb.D = xd[1], pb.E = w1d[0], pb.F = strips ? w1d[2] * kStrip : w1d[3];
  const bool w2_ok = strips ? w2d.size() == 4 && w2d[1] * kStrip == pb.D && w2d[2] == pb.F && w2d[3] == kStrip
                            : w2d.size() == 3 && w2d[1] == pb.F && w2d[2] == pb.D;
  if (!w2_ok || w2d[0] != pb.E)
    return ffi::Error::InvalidArgument("moe_experts: w2 must be [E, F, D], or [E, D / 32, F, 32] with w1 in strips");
  for (const char* problem : {weights_of(w1, w1_scale, wsz, pb.D, pb.F, pb.w1),
                              weights_of(w2, w2_scale, wsz, pb.F, pb.D, pb.w2)})
    if (*problem) return ffi::Error::InvalidArgument(std::string("moe_experts: ") + problem);
  if (strips) {
    if (pb.w1.scale != nullptr) return ffi::Error::InvalidArgument("moe_experts: experts in strips are float32");
    pb.w1.strip_stride = pb.D * kStrip;
    pb.w2.strip_stride = pb.F * kStrip;
  }
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
