// Work split across the intra-op threads in shares that a thread which finishes early helps to finish.
//
// Each thread takes its own contiguous share of indices from the front, in order (one sequential stream of weights);
// a thread whose share is done then takes the other shares' indices from their backs, one at a time. A call ends when
// its last index does, not when the slowest thread's share does: on this VM the two vCPUs stream at unequal and
// shifting speeds (equal shares of the 1.5B's int8 products, one row: one thread's took 0.87–1.11× the other's, medians
// per product). Over the 1.5B's 113 products, cold, against a static split (Zen 5 host, paired rounds binned by the
// memory's speed): int8 0.97–0.99 of the time at 1–16 rows, fp32 0.94–0.98 at 1–4 rows and 0.99–1.01 at 8–16.
// Taking panels from a shared counter in groups of 4 or 16 instead (no own stream) took 1.02–1.07×.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace specdec {

// One thread's share [front, back), claimed one index at a time from either end: one atomic word, so no index is
// taken twice.
struct alignas(64) Share {
  std::atomic<uint64_t> bounds{0};

  void reset(int64_t front, int64_t back) {
    bounds.store(static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front), std::memory_order_relaxed);
  }

  // the next index from the front (own) or the back (helping), or −1 when the share is done
  int64_t take(bool from_front) {
    uint64_t b = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const auto front = static_cast<int64_t>(b & 0xFFFFFFFFu), back = static_cast<int64_t>(b >> 32);
      if (front >= back) return -1;
      const uint64_t taken = from_front ? b + 1 : b - (uint64_t{1} << 32);
      if (bounds.compare_exchange_weak(b, taken, std::memory_order_acq_rel)) return from_front ? front : back - 1;
    }
  }
};

// What one thread of `parallel_shares` runs next: its own share's indices in order, then the others' from their backs.
class ShareCursor {
 public:
  ShareCursor(Share* shares, int64_t count, int64_t own_first, int64_t own_last)
      : shares_(shares), count_(count), first_(own_first), own_(own_first), own_last_(own_last) {}

  // the next index, and whether it is from this thread's own share (its successor is then its next, worth
  // prefetching); false when every share is done
  bool next(int64_t& index, bool& own) {
    for (; own_ < own_last_; ++own_) {
      if ((index = shares_[own_].take(true)) >= 0) {
        own = true;
        return true;
      }
    }
    for (; helped_ < count_; ++helped_) {  // the shares after this thread's first, in turn
      if ((index = shares_[(first_ + 1 + helped_) % count_].take(false)) >= 0) {
        own = false;
        return true;
      }
    }
    return false;
  }

  bool next(int64_t& index) {
    bool own;
    return next(index, own);
  }

 private:
  Share* shares_;
  int64_t count_, first_, own_, own_last_, helped_ = 0;
};

// Runs `thread_body(ShareCursor&)` once on each intra-op thread, over indices [0, count) in near-equal shares.
template <class ThreadBody>
void parallel_shares(int64_t count, const ThreadBody& thread_body) {
  if (count <= 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) shares[t].reset(t * count / threads, (t + 1) * count / threads);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    ShareCursor cursor(shares.get(), threads, first, last);
    thread_body(cursor);
  });
}

}  // namespace specdec
