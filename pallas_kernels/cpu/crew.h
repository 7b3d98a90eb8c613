// The kernels' own helper threads: a crew that stays awake between the calls of one step.
//
// Why not XLA's intra-op pool: a decode step of a few rows is a chain of ~100 custom calls of
// 50-150 us each, and a pool thread parks between them; waking it costs 20-40 us on this
// kind of machine (a virtual CPU's wake-up), so a 2-thread matmul ran at ~14 GB/s where two
// threads stream ~23 GB/s. The crew spins (politely: pause, then yield) for a short while
// after each job, so the next call of the chain finds it awake; then it sleeps.
//
// One job at a time: a call that finds the crew busy (XLA runs independent custom calls
// concurrently, e.g. the q, k, v projections) runs its tasks alone on its own thread. A
// caller never waits for a helper that has not started: it claims tasks itself and waits
// only for tasks a helper claimed, so no call can deadlock on the crew.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define METRALE_CPU_RELAX() _mm_pause()
#else
#define METRALE_CPU_RELAX() ((void)0)
#endif

namespace metrale {

class Crew {
 public:
  // How long a helper stays awake after its last job: longer than the gap between two
  // custom calls of a step (norms, rope, small fusions), short enough not to hold a core
  // from whatever runs next.
  static constexpr std::chrono::microseconds kAwake{300};

  // The process's crew: one helper per usable core beyond the caller's, started on first use.
  static Crew& Get() {
    static Crew* crew = new Crew(UsableCores() - 1);  // never destroyed: threads outlive exit
    return *crew;
  }

  int64_t threads() const { return static_cast<int64_t>(helpers_.size()) + 1; }

  // fn(t) for every t in [0, count), on this thread and any helper that joins in time.
  template <typename Fn>
  void Run(int64_t count, Fn&& fn) {
    if (count <= 1 || helpers_.empty() || busy_.exchange(true, std::memory_order_acquire)) {
      for (int64_t t = 0; t < count; ++t) fn(t);
      return;
    }
    const std::function<void(int64_t)> call = std::forward<Fn>(fn);
    call_.store(&call, std::memory_order_relaxed);
    count_.store(count, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = ++epoch_ & 0xffffffffu;
    // Publishes the job (a helper that reads this epoch also sees call_ and count_); seq_cst
    // against a helper going to sleep: either it sees the job or this sees it asleep.
    next_.store(epoch << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    const int64_t mine = Drain(epoch);
    // Every task is claimed now; wait for those the helpers claimed.
    for (int spins = 1; done_.load(std::memory_order_acquire) + mine < count; ++spins) {
      METRALE_CPU_RELAX();
      if ((spins & 63) == 0) sched_yield();  // a helper preempted mid-task gets the core
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  explicit Crew(int64_t helpers) {
    for (int64_t i = 0; i < std::min<int64_t>(helpers, 63); ++i)
      helpers_.emplace_back([this] { Serve(); });
    for (auto& h : helpers_) h.detach();
  }

  static int64_t UsableCores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(CPU_COUNT(&set), 1);
    return std::max<int64_t>(std::thread::hardware_concurrency(), 1);
  }

  // Claims and runs tasks of job `epoch` until none is left; returns how many it ran. A
  // claim is a compare-exchange on (epoch, next task), so a helper that woke late for an
  // earlier job can never take a task of a later one.
  int64_t Drain(uint64_t epoch) {
    int64_t ran = 0;
    uint64_t seen = next_.load(std::memory_order_acquire);
    while ((seen >> 32) == epoch) {
      const int64_t task = static_cast<int64_t>(seen & 0xffffffffu);
      const std::function<void(int64_t)>* call = call_.load(std::memory_order_relaxed);
      const int64_t count = count_.load(std::memory_order_relaxed);
      if (task >= count) break;
      if (next_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
        (*call)(task);
        ++ran;
        seen = next_.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  void Serve() {
    uint64_t served = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kAwake;
      uint64_t epoch = next_.load(std::memory_order_acquire) >> 32;
      for (int spins = 0; epoch == served; ++spins) {
        METRALE_CPU_RELAX();
        if ((spins & 63) == 63) {
          if (std::chrono::steady_clock::now() > until) {
            Sleep(served);
          } else {
            sched_yield();  // a runnable thread on this core (XLA's, the host's) goes first
          }
        }
        epoch = next_.load(std::memory_order_acquire) >> 32;
      }
      served = epoch;
      const int64_t ran = Drain(epoch);
      if (ran) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  void Sleep(uint64_t served) {
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lock, [&] { return (next_.load(std::memory_order_seq_cst) >> 32) != served; });
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  std::vector<std::thread> helpers_;
  std::atomic<bool> busy_{false};            // a caller owns the crew
  uint64_t epoch_ = 0;                       // jobs started (owner only)
  std::atomic<uint64_t> next_{0};            // (job epoch mod 2^32 << 32) | next task
  std::atomic<const std::function<void(int64_t)>*> call_{nullptr};  // valid while it runs
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> done_{0};             // tasks the helpers finished for this job
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace metrale
