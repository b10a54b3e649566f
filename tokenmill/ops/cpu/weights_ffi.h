// weights_of: an FFI weight buffer as gemm.h's Weights, for the kernels built on gemm.h.

#pragma once

#include <cstdint>

#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace {

// `buf` as Weights with N columns and a reduction axis of `reduction` rows (the leading axes stack
// such matrices: experts, layers); returns "" when usable, else what is wrong.
static const char* weights_of(const xla::ffi::AnyBuffer& buf, const xla::ffi::Buffer<xla::ffi::F32>& scale, int64_t wsz,
                              int64_t reduction, int64_t N, Weights& w) {
  w.data = static_cast<const char*>(buf.untyped_data());
  w.N = N;
  switch (buf.element_type()) {
    case xla::ffi::DataType::F32:
      w.elem = 4;
      return wsz == 0 ? "" : "float32 weights take no scales";
    case xla::ffi::DataType::S8:
      w.is_int8 = true;
      break;
    case xla::ffi::DataType::F8E4M3FN:
      w.table = kE4M3.data();
      break;
    case xla::ffi::DataType::F8E5M2:
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

}  // namespace
