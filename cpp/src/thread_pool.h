// A fixed pool of worker threads for the CPU backend's data-parallel loops and the loader's
// conversions.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "diffuserve/dtype.h"

namespace diffuserve {

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 1024;

  // A pool of num_threads threads (the caller's included). num_threads <= 0: the
  // process-wide pool (DIFFUSERVE_NUM_THREADS, else a thread for every CPU the process may run
  // on, at most kMaxThreads), shared by every
  // backend that does not ask for a thread count of its own, so that many models in one
  // process do not each start a thread per core. More than kMaxThreads, or more than the
  // OS will start, is an InvalidArgument. A process forked from this one has none of the
  // threads: there the caller runs every loop alone, and the pool is never deleted (its
  // condition variables still count the parent's waiting workers, and destroying them
  // would wait forever).
  static std::shared_ptr<ThreadPool> make(int num_threads);
  ~ThreadPool();

  int size() const { return int(workers_.size()) + 1; }

  // Runs fn(begin, end) over [0, n) split into about size() * 4 chunks of at least
  // `grain` items; the calling thread works too. Returns when every chunk is done; the
  // first exception thrown by a chunk is rethrown here.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  // num_threads <= 0: DIFFUSERVE_NUM_THREADS, else the hardware's thread count.
  explicit ThreadPool(int num_threads);
  void worker_loop();
  void stop_workers();
  // Whether this is a process forked from the one that started the workers.
  bool forked() const;
  // Spins (without the lock) until ready() or about 50 us have passed: a CPU step runs a
  // few hundred loops back to back, each a few tens of microseconds, and a thread put to
  // sleep between them takes about as long again to wake.
  template <typename Ready>
  static void spin_until(Ready ready);

  const int owner_;  // the process id that started the workers
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0, job_chunk_ = 0, next_ = 0;
  // Written under mutex_; atomic so that a spinning thread may read them without it.
  std::atomic<int64_t> pending_ = 0;
  std::atomic<uint64_t> generation_ = 0;  // one more with each job, and at stop
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex call_mutex_;  // one parallel_for at a time
};

// convert_floats(src, from, n, dst, to) on the pool's threads, a chunk of 1 MB or more of
// output each (a plain copy where the two types are alike): a loader's pass over a weight.
void convert_floats(ThreadPool& pool, const void* src, DType from, int64_t n, void* dst, DType to);

}  // namespace diffuserve
