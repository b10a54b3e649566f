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
// intra-op pool (parallel.h); a token may appear in several experts, so each thread sums into its
// own output buffer and those are added into `out` at the end.
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

// One thread's working space, and its share of the output (a token may go to experts that
// different threads compute: the shares are summed at the end).
struct Scratch {
  std::vector<float> x, gate, up, y, out;
  GemmBuffers gemm;
  explicit Scratch(const Problem& pb)
      : x(kChunkRows * pb.D),
        gate(kChunkRows * pb.F),
        up(kChunkRows * pb.F),
        y(kChunkRows * pb.D),
        out(pb.T * pb.D, 0.f),
        gemm(kChunkRows, std::max(pb.D, pb.F)) {}
};

static void run_item(const Problem& pb, int64_t item, Scratch& s) {
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
  matmul(n, F, D, s.x.data(), gate, s.gate.data(), s.gemm, &up);
  matmul(n, F, D, s.x.data(), up, s.up.data(), s.gemm, &down);
  const float* bg = pb.b1 + e * 2 * F;
  const float* bu = bg + F;
  for (int64_t i = 0; i < n; ++i) {
    float* g = s.gate.data() + i * F;
    const float* u = s.up.data() + i * F;
    for (int64_t f = 0; f < F; ++f) g[f] = gated(g[f] + bg[f], u[f] + bu[f], pb.act, pb.alpha, pb.limit);
  }
  matmul(n, D, F, s.gate.data(), down, s.y.data(), s.gemm);
  const float* b2 = pb.b2 + e * D;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = pb.sorted_token[r0 + i];
    if (t < 0 || t >= pb.T) continue;  // not a local assignment
    const float w = pb.sorted_weight[r0 + i];
    float* o = s.out.data() + int64_t(t) * D;
    const float* y = s.y.data() + i * D;
    for (int64_t d = 0; d < D; ++d) o[d] += w * (y[d] + b2[d]);
  }
}

static void run(ffi::ThreadPool& pool, const Problem& pb, float* out) {
  std::fill(out, out + pb.T * pb.D, 0.f);
  const auto shares = parallel_for<Scratch>(
      pool, int64_t(pb.item_expert.size()), [&pb] { return std::make_unique<Scratch>(pb); },
      [&pb](int64_t item, Scratch& s) { run_item(pb, item, s); });
  for (const auto& share : shares)
    for (int64_t j = 0; j < pb.T * pb.D; ++j) out[j] += share->out[j];
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
