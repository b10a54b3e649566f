// parallel_for for the CPU kernels: work items spread over the calling thread and helpers.
//
// Items are claimed one at a time from an atomic counter by the calling thread and by helper tasks.
// The caller waits only for items that were claimed, so a helper that never gets a thread (or
// starts after the end) cannot block it. The counters live in a reference-counted block that late
// helpers may still touch; what lives on the caller's stack (make, body) is used only after a
// successful claim, i.e. while the caller still waits.
//
// The helpers are tasks on XLA's intra-op thread pool, or, for the short calls of a decode step
// (`spin`), SpinningHelpers: a task handed to the pool there started ~50 µs late on average (its
// threads had parked between the kernel calls), about as long as a whole GEMV of a decode step.
// Spinning threads would slow long calls instead (W1 -8%): they take CPU from XLA's own threads.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace tokenmill_cpu {

// Threads that run the latest posted job. An idle one yields its core (to whatever else is runnable)
// for kSpin before it sleeps, so the next job of a decode step finds it awake. A helper that is busy
// when a job is posted may miss it: that job's caller does the items.
//
// One set per process for all the kernel libraries: outside the anonymous namespace, get()'s static
// is a GNU unique symbol (g++), which the dynamic linker binds to one object in every library loaded.
// With a set per library, a decode step had the attention's idle helper spinning against the
// GEMV's working one on the same core (W2 8-bit: +3-12%). Without unique symbols (other compilers)
// each library keeps its own set, as before.
class SpinningHelpers {
 public:
  static constexpr std::chrono::microseconds kSpin{300};

  static SpinningHelpers& get() {
    static SpinningHelpers* helpers = new SpinningHelpers();  // never destroyed: its threads never end
    return *helpers;
  }

  // job() on up to `count` helpers (started on first use)
  void post(std::function<void()> job, int64_t count) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (int64_t(threads_.size()) < count) threads_.emplace_back([this] { loop(); });
      job_ = std::move(job);
      wanted_ = count;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto idle_since = std::chrono::steady_clock::now();
      for (int spins = 1; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        std::this_thread::yield();
        if (spins % 16 == 0 && std::chrono::steady_clock::now() - idle_since > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      std::function<void()> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        if (wanted_ > 0) {
          --wanted_;
          job = job_;
        }
      }
      if (job) job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::function<void()> job_;  // guarded by mu_
  int64_t wanted_ = 0;  // helpers still to take job_ (guarded by mu_)
  std::vector<std::thread> threads_;  // guarded by mu_
};

}  // namespace tokenmill_cpu

namespace {

using tokenmill_cpu::SpinningHelpers;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

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
// A body that takes (item, following, state) is told the item its thread runs after this one (-1:
// none): each thread claims one item ahead, so that the body can prefetch for it.
// `spin`: the helpers are SpinningHelpers (short calls, one after the other), else pool tasks.
template <typename State, typename Make, typename Body>
std::vector<std::unique_ptr<State>> parallel_for(xla::ffi::ThreadPool& pool, int64_t items, const Make& make,
                                                 const Body& body, bool spin = false) {
  if (items <= 0) return {};
  auto run = std::make_shared<ParallelRun<State>>();
  run->total = items;
  const Make* make_ptr = &make;
  const Body* body_ptr = &body;
  auto work = [run, make_ptr, body_ptr]() {
    std::unique_ptr<State> state;
    int64_t mine = 0;
    for (int64_t i = run->next.fetch_add(1, std::memory_order_relaxed); i < run->total;) {
      if (!state) state = (*make_ptr)();
      if constexpr (std::is_invocable_v<const Body&, int64_t, int64_t, State&>) {
        const int64_t following = run->next.fetch_add(1, std::memory_order_relaxed);
        (*body_ptr)(i, following < run->total ? following : -1, *state);
        i = following;
      } else {
        (*body_ptr)(i, *state);
        i = run->next.fetch_add(1, std::memory_order_relaxed);
      }
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
  if (spin && threads > 1)
    SpinningHelpers::get().post(work, threads - 1);
  else
    for (int64_t i = 1; i < threads; ++i) pool.Schedule([work] { work(); });
  work();
  // A short call's caller waits awake for the helpers' last items. Asleep on the condition variable,
  // the decode step's linear calls waited 13.1 µs on average for their helper, awake 4.9 (W2 8-bit:
  // the decode step alone 8.25 -> 7.87 ms, the engine's 8.6 -> 7.7, medians of 4 alternating runs).
  // It yields after a few pauses, so that a helper sharing its core gets it.
  if (spin)
    for (int spins = 0; run->done.load(std::memory_order_acquire) != items; ++spins) {
      if (spins < 64)
        cpu_relax();
      else
        std::this_thread::yield();
    }
  std::unique_lock<std::mutex> lock(run->mu);
  run->cv.wait(lock, [&] { return run->done.load(std::memory_order_acquire) == items; });
  return std::move(run->states);
}

}  // namespace
