// parallel_for for the CPU kernels: work items spread over XLA's intra-op thread pool.
//
// Items are claimed one at a time from an atomic counter by the calling thread and by helper tasks
// on the pool. The caller waits only for items that were claimed, so a helper that never gets a
// thread (or starts after the end) cannot block it. The counters live in a reference-counted block
// that late helpers may still touch; what lives on the caller's stack (make, body) is used only
// after a successful claim, i.e. while the caller still waits.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace {

template <typename State>
struct ParallelRun {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<State>> states;  // guarded by mu
};

// Runs body(item, state) for every item in [0, items). Each thread that claims an item first makes
// its own state with make(); the states come back to the caller (to combine per-thread results).
template <typename State, typename Make, typename Body>
std::vector<std::unique_ptr<State>> parallel_for(xla::ffi::ThreadPool& pool, int64_t items, const Make& make,
                                                 const Body& body) {
  if (items <= 0) return {};
  auto run = std::make_shared<ParallelRun<State>>();
  run->total = items;
  const Make* make_ptr = &make;
  const Body* body_ptr = &body;
  auto work = [run, make_ptr, body_ptr]() {
    std::unique_ptr<State> state;
    int64_t mine = 0;
    for (;;) {
      const int64_t i = run->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= run->total) break;
      if (!state) state = (*make_ptr)();
      (*body_ptr)(i, *state);
      ++mine;
    }
    if (mine == 0) return;
    {
      std::lock_guard<std::mutex> lock(run->mu);
      run->states.push_back(std::move(state));
    }
    if (run->done.fetch_add(mine, std::memory_order_acq_rel) + mine == run->total) {
      { std::lock_guard<std::mutex> lock(run->mu); }
      run->cv.notify_all();
    }
  };
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), items);
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(run->mu);
  run->cv.wait(lock, [&] { return run->done.load(std::memory_order_acquire) == items; });
  return std::move(run->states);
}

}  // namespace
