#include "thread_pool.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>

#include <sched.h>
#include <unistd.h>

#include "cgroup.h"
#include "diffuserve/errors.h"

namespace diffuserve {

namespace {

// The CPUs this process may run on: its affinity mask (a container's cpuset, taskset), which
// hardware_concurrency ignores (on a 2-CPU container of a 128-thread host the pool had run 128
// threads on 2 CPUs), and its CPU quota rounded up (docker's --cpus: a thread a host CPU had
// been throttled, 1.9x slower at 16 threads on a quota of one CPU), at most kMaxThreads (a
// larger host had been refused its default).
int available_cpus() {
  int cpus = int(std::thread::hardware_concurrency());
#ifdef __linux__
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof mask, &mask) == 0) cpus = CPU_COUNT(&mask);  // (fails past 1,024 CPUs)
#endif
  if (const double quota = cgroup_limits().cpus; quota > 0 && quota < cpus) cpus = int(std::ceil(quota));
  return std::clamp(cpus, 1, ThreadPool::kMaxThreads);
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) : owner_(getpid()) {
  std::string source = "num_threads";
  if (num_threads <= 0) {
    // DIFFUSERVE_NUM_THREADS, where set, is a count up to kMaxThreads, 0 every CPU the process
    // may run on (an empty one is unset).
    const char* env = std::getenv("DIFFUSERVE_NUM_THREADS");
    if (env && *env) {
      source = "DIFFUSERVE_NUM_THREADS";
      const char* end = env + std::strlen(env);
      const auto [at, error] = std::from_chars(env, end, num_threads);
      if (error != std::errc() || at != end || num_threads < 0)
        throw InvalidArgument("DIFFUSERVE_NUM_THREADS='" + std::string(env) + "' is not a thread count (up to " +
                              std::to_string(kMaxThreads) + "; 0: every CPU this process may run on)");
    }
  }
  if (num_threads <= 0) num_threads = available_cpus();
  if (num_threads > kMaxThreads)
    throw InvalidArgument(source + " " + std::to_string(num_threads) + " is more than " + std::to_string(kMaxThreads));
  try {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error& e) {  // the OS refused a thread: stop the ones started
    stop_workers();
    throw InvalidArgument("cannot start " + std::to_string(num_threads) + " threads (num_threads): " + e.what());
  }
}

bool ThreadPool::forked() const { return getpid() != owner_; }

std::shared_ptr<ThreadPool> ThreadPool::make(int num_threads) {
  const auto started = [](int n) {
    return std::shared_ptr<ThreadPool>(new ThreadPool(n), [](ThreadPool* pool) {
      if (!pool->forked()) delete pool;
    });
  };
  if (num_threads > 0) return started(num_threads);
  static std::mutex mutex;
  static std::weak_ptr<ThreadPool> shared;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<ThreadPool> pool = shared.lock();
  if (!pool || pool->forked()) shared = pool = started(0);  // (a forked child's own)
  return pool;
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    ++generation_;  // ends a worker's spin
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + size() * 4 - 1) / (size() * 4));
  if (workers_.empty() || chunk >= n || forked()) {  // (a forked child's caller works alone)
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = chunk;
  next_ = 0;
  pending_ = (n + chunk - 1) / chunk;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  // The caller takes chunks too, then waits for the stragglers.
  while (next_ < job_n_) {
    const int64_t begin = next_;
    next_ = std::min(job_n_, begin + job_chunk_);
    const int64_t end = next_;
    lock.unlock();
    try {
      fn(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> g(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    --pending_;
  }
  if (pending_ > 0) {
    lock.unlock();
    spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    lock.lock();
    done_.wait(lock, [&] { return pending_ == 0; });
  }
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    while (job_ && next_ < job_n_) {
      const int64_t begin = next_;
      next_ = std::min(job_n_, begin + job_chunk_);
      const int64_t end = next_;
      const auto* fn = job_;
      lock.unlock();
      try {
        (*fn)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
    if (stop_) return;
    const uint64_t seen = generation_;
    lock.unlock();
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    lock.lock();
    wake_.wait(lock, [&] { return generation_ != seen; });
  }
}

template <typename Ready>
void ThreadPool::spin_until(Ready ready) {
  constexpr auto kSpin = std::chrono::microseconds(50);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; !ready(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) return;
  }
}

void convert_floats(ThreadPool& pool, const void* src, DType from, int64_t n, void* dst, DType to) {
  const size_t in_size = dtype_size(from), out_size = dtype_size(to);
  pool.parallel_for(n, int64_t((size_t(1) << 20) / out_size), [&](int64_t a, int64_t b) {
    const uint8_t* in = static_cast<const uint8_t*>(src) + size_t(a) * in_size;
    uint8_t* out = static_cast<uint8_t*>(dst) + size_t(a) * out_size;
    if (from == to) std::memcpy(out, in, size_t(b - a) * out_size);
    else convert_floats(in, from, b - a, out, to);
  });
}

}  // namespace diffuserve
