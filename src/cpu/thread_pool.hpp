// A small persistent thread pool for the CPU backend.
//
// parallel_for splits [0, n) into contiguous parts, one per thread, by a fixed formula (static
// partitioning). Callers partition over OUTPUT elements and compute each element entirely inside
// one part, in a fixed order, so results are bitwise identical for every thread count.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace moeblaze {
namespace cpu {

class ThreadPool {
 public:
  // num_threads <= 0: MOEBLAZE_NUM_THREADS if set, else one per hardware thread.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // 0: one per hardware thread. Waits for a parallel_for in flight on another thread.
  void set_num_threads(int num_threads);
  int num_threads() const;

  // A non-owning reference to a callable `void(int64_t begin, int64_t end)`. Unlike std::function
  // it never allocates, whatever the callable captures: execute calls must not touch the heap.
  class RangeBody {
   public:
    template <typename F>
    explicit RangeBody(F& body)
        : object_(const_cast<void*>(static_cast<const void*>(&body))), call_(&invoke<F>) {}
    void operator()(int64_t begin, int64_t end) const { call_(object_, begin, end); }

   private:
    template <typename F>
    static void invoke(void* object, int64_t begin, int64_t end) {
      (*static_cast<F*>(object))(begin, end);
    }
    void* object_;
    void (*call_)(void*, int64_t, int64_t);
  };

  // Calls body(begin, end) on disjoint contiguous ranges covering [0, n); returns when all are
  // done. Rethrows the first exception a part threw. If another thread is using the pool, runs the
  // whole range on the calling thread (same results, by the partitioning rule above).
  template <typename F>
  void parallel_for(int64_t n, F&& body) {
    run(n, RangeBody(body));
  }

  // The default thread count: MOEBLAZE_NUM_THREADS, else hardware concurrency (at least 1).
  static int default_num_threads();

 private:
  void start_workers(int count);
  void stop_workers();
  void worker_loop(int worker_index, uint64_t seen_generation);
  void run(int64_t n, RangeBody body);

  mutable std::mutex config_mutex_;  // guards num_threads_ and the worker set
  std::mutex busy_mutex_;            // held by the thread that owns the pool for one parallel_for
  int num_threads_ = 1;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  int pending_ = 0;
  int64_t job_n_ = 0;
  int job_parts_ = 0;
  const RangeBody* job_body_ = nullptr;
  std::exception_ptr job_error_;
};

}  // namespace cpu
}  // namespace moeblaze
