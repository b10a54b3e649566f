// Greedy sampling's argmax on CPU, called from JAX through the XLA FFI (target "tokenmill_argmax");
// tokenmill/ops/cpu/argmax.py is its Python side.
//
//   ids[r] = the first index of the largest value of x[r]   (x [R, V] float32, ids [R] int32)
//
// with jnp.argmax's semantics: a NaN counts as larger than everything (the first NaN wins), and ties
// go to the first index. XLA lowers jnp.argmax to a scalar reduce over (value, index) pairs on one
// thread: 4.5 ms for SmolLM2's 64 x 49152 logits, ~4% of a decode step at batch 64. Here each row is
// two vector passes (its maximum, then where that maximum first occurs; the row stays in L2 between
// them), the rows spread over the intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kW * sizeof(int32_t))));

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// The argmax of row[0:V]
int32_t row_argmax(const float* row, int64_t V) {
  // pass 1: the maximum, and whether the row holds a NaN (x != x)
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
  if (V >= kW) {
    vf m = load(row);
    vi unordered = m != m;
    for (i = kW; i + kW <= V; i += kW) {
      const vf x = load(row + i);
      m = x > m ? x : m;
      unordered |= x != x;
    }
    for (int j = 0; j < kW; ++j) {
      best = std::max(best, m[j]);
      nan |= unordered[j] != 0;
    }
  }
  for (; i < V; ++i) {
    best = std::max(best, row[i]);
    nan |= std::isnan(row[i]);
  }
  // pass 2: where it first occurs (the first NaN, if any)
  for (int64_t j = 0; j < V; j += kW) {
    if (j + kW <= V) {
      const vf x = load(row + j);
      const vi hit = nan ? x != x : x == best;
      bool any = false;
      for (int k = 0; k < kW; ++k) any |= hit[k] != 0;
      if (!any) continue;
    }
    for (int64_t k = j; k < std::min(V, j + kW); ++k)
      if (nan ? std::isnan(row[k]) : row[k] == best) return int32_t(k);
  }
  return 0;  // V == 0 (a row of -inf finds its first -inf above)
}

// Rows per work item: a few, so that a batch of one or two rows stays on the calling thread.
constexpr int64_t kRowsPerItem = 4;

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  auto d = x.dimensions();
  if (d.size() != 2 || ids->element_count() != size_t(d[0]))
    return ffi::Error::InvalidArgument("argmax: expected x [R, V] and ids [R]");
  const int64_t R = d[0], V = d[1];
  const float* xp = x.typed_data();
  int32_t* out = ids->typed_data();
  struct NoState {};
  parallel_for<NoState>(
      pool, (R + kRowsPerItem - 1) / kRowsPerItem, [] { return std::make_unique<NoState>(); },
      [&](int64_t item, NoState&) {
        for (int64_t r = item * kRowsPerItem; r < std::min(R, (item + 1) * kRowsPerItem); ++r)
          out[r] = row_argmax(xp + r * V, V);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // ids [R]
