// The gated MLP's activation for the linear kernel (linear.cc): h = silu(gate) * up, applied to a
// fused gate/up projection's output while it is still in cache, instead of by XLA over all of it
// afterwards (which read the [M, 2I] product back from memory). Included after gemm.h (vf, kVW).

#pragma once

#include <cmath>
#include <cstdint>

#include "vector_exp.h"

namespace {

typedef int32_t vi __attribute__((vector_size(kVW * sizeof(int32_t))));

// e^x on a vector, x clamped to [-87.3, 88.7] (e^x stays a normal float)
TM_INLINE vf exp_clamped(vf x) {
  x = x < -87.33654f ? vf{} - 87.33654f : x;
  x = x > 88.72283f ? vf{} + 88.72283f : x;
  return exp_in_range<vf, vi>(x);
}

// out[r * ldo + c] = silu(y[r * ldy + c]) * y[r * ldy + up + c] for r < rows, c < cols: silu(g) =
// g / (1 + e^-g), the gate's columns first in each row of y and the up projection's `up` further on
TM_INLINE void silu_gate(const float* y, int64_t ldy, int64_t up, int64_t rows, int64_t cols, float* out,
                         int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = y + r * ldy;
    float* o = out + r * ldo;
    int64_t c = 0;
    for (; c + kVW <= cols; c += kVW) {
      const vf x = loadv(g + c);
      storev(o + c, x / (1.0f + exp_clamped(-x)) * loadv(g + up + c));
    }
    for (; c < cols; ++c) o[c] = g[c] / (1.0f + std::exp(-g[c])) * g[up + c];
  }
}

}  // namespace
