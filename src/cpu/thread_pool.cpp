#include "cpu/thread_pool.hpp"

#include <algorithm>
#include <cstdlib>

namespace moeblaze {
namespace cpu {

namespace {

int hardware_threads() {
  const unsigned count = std::thread::hardware_concurrency();
  return count == 0 ? 1 : int(count);
}

// Part p of `parts` covers [n*p/parts, n*(p+1)/parts): a pure function of (n, parts, p).
void part_range(int64_t n, int parts, int p, int64_t* begin, int64_t* end) {
  *begin = n * p / parts;
  *end = n * (p + 1) / parts;
}

}  // namespace

int ThreadPool::default_num_threads() {
  if (const char* env = std::getenv("MOEBLAZE_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(env, &end, 10);
    if (end != env && value > 0) return int(std::min<long>(value, 1024));
  }
  return hardware_threads();
}

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads : default_num_threads()) {}

ThreadPool::~ThreadPool() {
  stop_workers();
}

int ThreadPool::num_threads() const {
  std::lock_guard<std::mutex> lock(config_mutex_);
  return num_threads_;
}

void ThreadPool::set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> busy(busy_mutex_);
  stop_workers();
  std::lock_guard<std::mutex> lock(config_mutex_);
  num_threads_ = num_threads > 0 ? std::min(num_threads, 1024) : hardware_threads();
}

void ThreadPool::start_workers(int count) {
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = false;
    generation = generation_;
  }
  // Each worker starts from the generation current now, so a job posted before it first runs is
  // still seen as new.
  for (int i = 0; i < count; ++i) {
    workers_.emplace_back([this, i, generation] { worker_loop(i, generation); });
  }
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
}

void ThreadPool::worker_loop(int worker_index, uint64_t seen) {
  for (;;) {
    int64_t n = 0;
    int parts = 0;
    const RangeBody* body = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      n = job_n_;
      parts = job_parts_;
      body = job_body_;
    }
    const int part = worker_index + 1;  // part 0 belongs to the calling thread
    if (part < parts) {
      int64_t begin, end;
      part_range(n, parts, part, &begin, &end);
      try {
        if (begin < end) (*body)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!job_error_) job_error_ = std::current_exception();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_ == 0) work_done_.notify_one();
  }
}

void ThreadPool::run(int64_t n, RangeBody body) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> busy(busy_mutex_, std::try_to_lock);
  const int threads = num_threads();
  const int parts = int(std::min<int64_t>(threads, n));
  if (!busy.owns_lock() || parts <= 1) {
    body(0, n);
    return;
  }
  if (int(workers_.size()) != threads - 1) {
    stop_workers();
    start_workers(threads - 1);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_n_ = n;
    job_parts_ = parts;
    job_body_ = &body;
    job_error_ = nullptr;
    pending_ = int(workers_.size());
    ++generation_;
  }
  work_ready_.notify_all();

  std::exception_ptr caller_error;
  int64_t begin, end;
  part_range(n, parts, 0, &begin, &end);
  try {
    body(begin, end);
  } catch (...) {
    caller_error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return pending_ == 0; });
  std::exception_ptr error = caller_error ? caller_error : job_error_;
  job_body_ = nullptr;
  job_error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace cpu
}  // namespace moeblaze
