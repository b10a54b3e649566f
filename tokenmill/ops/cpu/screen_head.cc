// The greedy head's screening copy of a float32 LM head, made once at load time (target
// "tokenmill_screen_head"); greedy_head.py's `screen_head` calls it, and its jnp form is the reference.
//
//   w [1, S, K, 32] float32 strips (column v: lane v % 32 of strip v / 32)
//   -> q [1, S, K, 32] int8: round(w / scale_v) clipped to +-127, scale_v = max_k |w_kv| / 127 (1 if 0)
//      scale [S * 32], and coeff [S * 32]:
//      coeff_v = (|q_v scale_v - w_v|_2 + gamma4 (|q_v scale_v|_2 + |w_v|_2)) * factor
//
// (gamma4 and factor come from greedy_head.py, which says what they bound). XLA made this in several
// single-threaded passes over the head: ~0.3 s of every start for SmolLM2's 113 MB head on a Zen 3
// core. Here each strip is one work item: its absolute maxima in one pass over its K x 32 values,
// then codes and the three sums in a second while the strip is in cache.
// Codes and scales are the reference's bits (the same float32 arithmetic, rounding ties to even);
// the sums run in float64, so coeff is within the reference's float32 rounding of it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 32;  // columns per strip (gemm.h's kStrip)

struct NoState {};

// One strip: K rows of kLanes columns at `w`; its codes to `q`, scales and coefficients to
// `scale[0:kLanes]`, `coeff[0:kLanes]`
void screen_strip(const float* w, int64_t K, float gamma4, float factor, int8_t* q, float* scale, float* coeff) {
  float absmax[kLanes] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kLanes; ++j) absmax[j] = std::max(absmax[j], std::fabs(w[k * kLanes + j]));
  for (int64_t j = 0; j < kLanes; ++j)
    // times 1/127, as XLA computes the reference's absmax / 127; an all-zero column keeps scale 1, as
    // the reference's jnp.where gives it (a NaN weight, which std::max passes over here, makes its
    // column's coefficient NaN in both)
    scale[j] = absmax[j] > 0 ? absmax[j] * (1.0f / 127.0f) : 1.0f;
  float inverse[kLanes];  // XLA divides by the scale as times its reciprocal
  for (int64_t j = 0; j < kLanes; ++j) inverse[j] = 1.0f / scale[j];
  double error[kLanes] = {}, dequantized[kLanes] = {}, original[kLanes] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float x = w[k * kLanes + j];
      float code = std::nearbyint(x * inverse[j]);  // ties to even, the default rounding mode, as jnp.round
      code = code != code ? 0.0f : std::min(127.0f, std::max(-127.0f, code));
      q[k * kLanes + j] = int8_t(code);
      const float value = code * scale[j];
      error[j] += double(value - x) * double(value - x);
      dequantized[j] += double(value) * value;
      original[j] += double(x) * x;
    }
  }
  for (int64_t j = 0; j < kLanes; ++j)
    coeff[j] = float((std::sqrt(error[j]) + gamma4 * (std::sqrt(dequantized[j]) + std::sqrt(original[j]))) * factor);
}

ffi::Error ScreenHeadImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, float gamma4, float factor,
                          ffi::Result<ffi::Buffer<ffi::S8>> q, ffi::Result<ffi::Buffer<ffi::F32>> scale,
                          ffi::Result<ffi::Buffer<ffi::F32>> coeff) {
  const auto dims = w.dimensions();
  if (dims.size() != 4 || dims[0] != 1 || dims[3] != kLanes)
    return ffi::Error::InvalidArgument("screen_head: w must be [1, V / 32, K, 32] strips");
  const int64_t S = dims[1], K = dims[2];
  const float* wp = w.typed_data();
  int8_t* qp = q->typed_data();
  float* sp = scale->typed_data();
  float* cp = coeff->typed_data();
  parallel_for<NoState>(
      pool, S, [] { return std::make_unique<NoState>(); },
      [&](int64_t s, NoState&) {
        screen_strip(wp + s * K * kLanes, K, gamma4, factor, qp + s * K * kLanes, sp + s * kLanes, cp + s * kLanes);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillScreenHead, ScreenHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [1, V / 32, K, 32]
                                  .Attr<float>("gamma4")
                                  .Attr<float>("factor")
                                  .Ret<ffi::Buffer<ffi::S8>>()  // q [1, V / 32, K, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scale [V]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // coeff [V]
