// The LM head of a greedy step on CPU, called from JAX through the XLA FFI (target
// "tokenmill_greedy_head"); tokenmill/ops/cpu/greedy_head.py is its Python side.
//
//   logits[r] = x[r] . W   (x [R, K] float32, W the float32 head in strips [1, V / 32, K, 32])
//
// for the argmax only: every value that could be the row's largest is W's exact float32 logit, the
// very bits the linear kernel computes (its GEMV, on that value's strip), and every other value is
// below the row's largest. Decoding one stream reads the whole head per token (SmolLM2: 113 MB of its
// 540); here each row is first screened through an int8 copy of the head (Q [1, V / 32, K, 32], one
// scale per column, 28 MB), whose error against W's float32 logit is bounded:
//
//   |a_v - z_v| <= |x|_2 * c_v,  c_v >= |q_v - w_v|_2 + gamma_K (|q_v|_2 + |w_v|_2)
//
// (a_v the screened value, z_v the float32 logit, q_v the dequantized column, gamma_K = K u / (1 - K u)
// bounding each of the two FMA chains' rounding; greedy_head.py computes c with four times that gamma
// term and slack for the float32 arithmetic of the bound itself). With L the row's largest
// a_v - |x| c_v, a column can hold the maximum only if a_v + |x| c_v >= L: those columns get z_v, the
// others a_v - |x| c_v < L <= max z. A row whose bound is not finite, or with more than kMaxCandidates
// candidates, gets every z_v; a row of zeros, zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gemm.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Past this many candidates a row is multiplied whole: their strips, read one by one, would come to
// most of W (SmolLM2's rows leave 24 candidates at the median, at most 338 of 49152 in 176 rows).
constexpr int64_t kMaxCandidates = 1024;

// |x|_2 of a row, rounded up past the error of its float64 sum (the bound's factor)
float row_norm(const float* x, int64_t K) {
  double sum = 0;
  for (int64_t k = 0; k < K; ++k) sum += double(x[k]) * x[k];
  return float(std::sqrt(sum) * (1 + 1e-4));
}

// The largest lower bound a_v - |x| c_v over columns [n0, n1) of a row of screened values (NaNs
// ignored, as std::max ignores them in its second argument)
float lower_bound(const float* row, const float* coeff, float norm, int64_t n0, int64_t n1) {
  const vf nv = splat(norm);
  vf best = splat(-INFINITY);
  for (int64_t v = n0; v < n1; v += kVW) {
    const vf low = loadv(row + v) - nv * loadv(coeff + v);
    best = low > best ? low : best;
  }
  float lower = -INFINITY;
  for (int j = 0; j < kVW; ++j) lower = std::max(lower, best[j]);
  return lower;
}

// Row r of the logits, its screened values a in `row` and L (`lower`, the largest a_v - |x| c_v)
// known: the candidates (a_v + |x| c_v >= L) get z_v, the others a_v - |x| c_v. Each candidate's strip
// is computed by the linear kernel's own GEMV (the same bits as the whole head's), one contiguous read a
// strip, strips spread over the threads.
void finish_row(xla::ffi::ThreadPool& pool, const float* x, int64_t K, const Weights& W, const float* coeff,
                int64_t V, float norm, float lower, float* row, std::vector<int32_t>& candidates) {
  if (norm == 0) {  // every FMA chain of zeros is +0 (for finite W): no need to read W at all
    std::fill(row, row + V, 0.f);
    return;
  }
  candidates.clear();
  if (std::isfinite(norm) && std::isfinite(lower)) {
    const vf nv = splat(norm), lv = splat(lower);
    for (int64_t v = 0; v < V; v += kVW) {  // the candidates; every value down to its lower bound
      const vf a = loadv(row + v), margin = nv * loadv(coeff + v);
      const auto keep = a + margin >= lv;
      for (int j = 0; j < kVW; ++j)
        if (keep[j]) candidates.push_back(int32_t(v + j));
      storev(row + v, a - margin);
    }
  }
  if (candidates.empty() || int64_t(candidates.size()) > kMaxCandidates) {
    gemv_rows(1, K, x, W, row, 0, V);  // every z_v (on this thread: a rare row)
    return;
  }
  std::vector<int64_t> first;  // where each strip's candidates start in `candidates` (ascending)
  for (size_t i = 0; i < candidates.size(); ++i)
    if (i == 0 || candidates[i] / kStrip != candidates[i - 1] / kStrip) first.push_back(int64_t(i));
  first.push_back(int64_t(candidates.size()));
  struct NoState {};
  parallel_for<NoState>(
      pool, int64_t(first.size()) - 1, [] { return std::make_unique<NoState>(); },
      [&](int64_t i, NoState&) {
        const int64_t n0 = candidates[first[i]] / kStrip * kStrip;
        float strip[kStrip];
        gemv_rows(1, K, x, W.columns_from(n0), strip, 0, kStrip);
        for (int64_t c = first[i]; c < first[i + 1]; ++c) row[candidates[c]] = strip[candidates[c] - n0];
      },
      /*spin=*/true);
}

ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> coeff,
                          ffi::Result<ffi::Buffer<ffi::F32>> logits) {
  auto xd = x.dimensions(), wd = w.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || qd.size() != 4 || wd[0] != 1 || wd[3] != kStrip)
    return ffi::Error::InvalidArgument("greedy_head: expected x [R, K], w and q [1, V / 32, K, 32]");
  const int64_t R = xd[0], K = xd[1], V = wd[1] * kStrip;
  for (size_t i = 0; i < 4; ++i)
    if (qd[i] != wd[i]) return ffi::Error::InvalidArgument("greedy_head: w and q differ in shape");
  if (wd[2] != K || scale.element_count() != size_t(V) || coeff.element_count() != size_t(V) ||
      logits->element_count() != size_t(R * V))
    return ffi::Error::InvalidArgument("greedy_head: expected scale [V], coeff [V], logits [R, V]");
  if (R > kGemvRows) return ffi::Error::InvalidArgument("greedy_head: at most 4 rows");
  if (R == 0 || V == 0) return ffi::Error::Success();

  Weights W;
  W.data = reinterpret_cast<const char*>(w.typed_data());
  W.N = V;
  W.strip_stride = K * kStrip;
  Weights Q;
  Q.data = reinterpret_cast<const char*>(q.typed_data());
  Q.N = V;
  Q.elem = 1;
  Q.is_int8 = true;
  Q.scale = scale.typed_data();
  Q.wsz = K;
  Q.strip_stride = K * kStrip;

  const float* xp = x.typed_data();
  const float* cp = coeff.typed_data();
  float* out = logits->typed_data();
  float norm[kGemvRows];
  for (int64_t r = 0; r < R; ++r) norm[r] = row_norm(xp + r * K, K);
  // the screening pass, each block's lower bounds with it, while its values are in cache (a pass of
  // one thread over the whole row afterwards, and the candidates' strips read one by one, took ~210 us
  // of SmolLM2's head; the call, alternated in one decoding process, 1364 -> 1217 us at the median):
  // blocks of whole strips, several per thread (a helper that starts late leaves at most one block to
  // the others)
  struct Lower {  // a thread's largest a_v - |x| c_v so far, per row
    float of_row[kGemvRows];
    Lower() { std::fill(of_row, of_row + kGemvRows, -INFINITY); }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t block = round_up(std::max<int64_t>(kStrip, (V + 24 * threads - 1) / (24 * threads)), kStrip);
  const auto lowers = parallel_for<Lower>(
      pool, (V + block - 1) / block, [] { return std::make_unique<Lower>(); },
      [&](int64_t i, Lower& lower) {
        const int64_t n0 = i * block, n1 = std::min(V, (i + 1) * block);
        gemv_rows(R, K, xp, Q, out, n0, n1);
        for (int64_t r = 0; r < R; ++r)
          lower.of_row[r] = std::max(lower.of_row[r], lower_bound(out + r * V, cp, norm[r], n0, n1));
      },
      /*spin=*/true);
  std::vector<int32_t> candidates;
  for (int64_t r = 0; r < R; ++r) {
    float lower = -INFINITY;
    for (const auto& l : lowers) lower = std::max(lower, l->of_row[r]);
    finish_row(pool, xp + r * K, K, W, cp, V, norm[r], lower, out + r * V, candidates);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillGreedyHead, GreedyHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [1, V / 32, K, 32]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // q [1, V / 32, K, 32]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coeff [V]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // logits [R, V]
