// e^x on GCC vector extensions (Cephes expf, ~1 ulp), shared by the attention's softmax
// (paged_attention.cc) and the gated MLP's SiLU (silu.h). V: a float vector type; I: the int32
// vector type of its width.

#pragma once

#include <cstdint>

namespace {

// e^x for x in [-87.33654, 88.72283] (the callers clamp): 2^n times a polynomial in what is left, the
// 2^n as two exact factors (n reaches 128 at the top of the range, one past a float's largest exponent)
template <typename V, typename I>
static inline __attribute__((always_inline)) V exp_in_range(V x) {
  V t = x * 1.44269504088896341f + 0.5f;
  V tf = __builtin_convertvector(__builtin_convertvector(t, I), V);
  tf = tf > t ? tf - 1.0f : tf;  // floor
  const I n = __builtin_convertvector(tf, I);
  x = x - tf * 0.693359375f;
  x = x + tf * 2.12194440e-4f;
  const V z = x * x;
  V y = V{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const I half = n >> 1;
  return y * (V)((half + 127) << 23) * (V)((n - half + 127) << 23);
}

}  // namespace
