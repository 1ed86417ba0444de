// The kernels' threads: OpenMP's, the same pool as torch's (the library links the libgomp.so.1 that
// torch has already loaded, so the process has one OpenMP runtime and torch.set_num_threads sizes both).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace sluice::cpu {

inline int num_threads() { return omp_get_max_threads(); }

inline bool in_parallel_region() { return omp_in_parallel() != 0; }

// at::parallel_for's contract: body(lo, hi) over [begin, end) in at most one contiguous chunk per thread,
// each of at least `grain` (but the last); the whole range at once on the caller when that is one chunk
// or when the caller is itself inside a parallel region. body must not throw.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t step = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min<int64_t>(num_threads(), (n + step - 1) / step);
  if (chunks <= 1 || in_parallel_region()) {
    body(begin, end);
    return;
  }
  const int64_t size = (n + chunks - 1) / chunks;
#pragma omp parallel num_threads(int(chunks))
  {
    // OpenMP may give a smaller team than asked for: its threads then take the chunks in turn.
    for (int64_t c = omp_get_thread_num(); c < chunks; c += omp_get_num_threads()) {
      const int64_t lo = begin + c * size;
      const int64_t hi = std::min(end, lo + size);
      if (lo < hi) body(lo, hi);
    }
  }
}

// item(i) for i in [0, items), the threads taking items from an atomic counter: a thread that the OS
// descheduled delays the call by at most the item it holds while the others keep taking work (static
// partitioning would leave its whole share waiting). Serial when `serial` or when there is one thread.
template <typename F>
void run_items(int64_t items, bool serial, const F& item) {
  const int threads = num_threads();
  if (serial || threads <= 1 || items <= 1 || in_parallel_region()) {
    for (int64_t i = 0; i < items; ++i) item(i);
    return;
  }
  std::atomic<int64_t> next{0};
  parallel_for(0, std::min<int64_t>(threads, items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item(i);
  });
}

// item(i, next) for i in [0, items): each thread owns a contiguous share of the items and takes them in order
// from its front, `next` being the one it will take after i (or -1), so that it can prefetch that item's data
// while it works on i. A thread whose share is done takes the others' items from their backs, as run_items
// would hand them out, so a descheduled thread still delays the call by at most the item it holds.
template <typename F>
void run_items_in_order(int64_t items, bool serial, const F& item) {
  const int threads = num_threads();
  if (serial || threads <= 1 || items <= 1 || in_parallel_region()) {
    for (int64_t i = 0; i < items; ++i) item(i, i + 1 < items ? i + 1 : -1);
    return;
  }
  const int shares = int(std::min<int64_t>(threads, items));
  // Each share's [front, back) in one word, front in the low half, so that a take is one compare-and-swap.
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds;
  };
  std::vector<Share> share(shares);
  for (int t = 0; t < shares; ++t)
    share[t].bounds.store(uint64_t(items * (t + 1) / shares) << 32 | uint64_t(items * t / shares));
  // The share's next item from its front (the owner) or its back (another thread); -1 when it is empty.
  auto take = [](Share& s, bool front) -> int64_t {
    uint64_t bounds = s.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = bounds & 0xFFFFFFFFu, hi = bounds >> 32;
      if (lo >= hi) return -1;
      const uint64_t taken = front ? hi << 32 | (lo + 1) : (hi - 1) << 32 | lo;
      if (s.bounds.compare_exchange_weak(bounds, taken, std::memory_order_relaxed)) return int64_t(front ? lo : hi - 1);
    }
  };
  parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own) {
      Share& mine = share[own];
      for (int64_t i = take(mine, true); i >= 0;) {
        const uint64_t bounds = mine.bounds.load(std::memory_order_relaxed);
        const int64_t next = (bounds & 0xFFFFFFFFu) < (bounds >> 32) ? int64_t(bounds & 0xFFFFFFFFu) : -1;
        item(i, next);
        i = take(mine, true);
      }
    }
    for (int64_t other = 0; other < shares; ++other)
      for (int64_t i = take(share[other], false); i >= 0; i = take(share[other], false)) item(i, -1);
  });
}

}  // namespace sluice::cpu
