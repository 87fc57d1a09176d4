// Peak extra host memory of a stretch of code, measured two ways:
//  - heap: this executable replaces the global operator new/delete with counting versions
//    (symbol interposition makes libflashattn's C++ allocations come here too), so the live and
//    peak bytes allocated through new (std::vector, make_unique, aligned new) are exact;
//  - RSS: the kernel's resident-set high-water mark (VmHWM), reset with /proc/self/clear_refs so
//    the peak belongs to the measured stretch alone; this also sees malloc/mmap, thread stacks and
//    page-granular effects. Where the reset is unavailable, getrusage's ru_maxrss is used, which
//    is only an upper bound of the growth past the process's earlier peak.
#pragma once

#include <cstdint>
#include <string>

namespace flashattn::cli {

class MemoryMeter {
 public:
  // Starts a measurement: remembers current heap and RSS, resets both peaks.
  void start();
  // Peak growth since start(), in bytes (never negative).
  int64_t heap_extra() const;
  int64_t rss_extra() const;
  // How the RSS figure was obtained ("VmHWM after clear_refs" or "ru_maxrss").
  const char* rss_method() const { return rss_exact_ ? "VmHWM reset via /proc/self/clear_refs" : "getrusage ru_maxrss"; }

 private:
  int64_t heap_base_ = 0, rss_base_ = 0;
  bool rss_exact_ = false;
};

int64_t heap_live_bytes();
int64_t current_rss_bytes();

}  // namespace flashattn::cli
