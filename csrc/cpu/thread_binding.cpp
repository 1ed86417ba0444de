// Pins torch's OpenMP threads to cores. Two unpinned threads on two cores collapse when any other
// process wants a core: the scheduler moves them around and one thread's share of every parallel
// region waits for the other. Pinned, each thread keeps its core's caches and its place.
#include <omp.h>
#include <sched.h>

#include <cerrno>

#include "check.h"
#include "ops.h"
#include "parallel.h"

namespace sluice::cpu {

std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpu_ids) {
  const int threads = num_threads();
  SK_CHECK(static_cast<int>(cpu_ids.size()) == threads, "bind_threads needs one core per thread: torch runs ",
           threads, " threads, got ", cpu_ids.size(), " cores");
  for (int64_t cpu : cpu_ids) SK_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "core id ", cpu, " is out of range");
  std::vector<int64_t> bound(threads, -1);
  // libgomp keeps one pool per calling thread and hands pool threads out in the same order to every
  // team of this size, so pinning thread i here pins thread i of every later parallel region that
  // this thread starts. Thread 0 is the caller itself.
#pragma omp parallel num_threads(threads)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpu_ids[i]), &set);
    // pid 0 is the calling thread, not the whole process.
    bound[i] = sched_setaffinity(0, sizeof(set), &set) == 0 ? cpu_ids[i] : -errno;
  }
  return bound;
}

}  // namespace sluice::cpu
