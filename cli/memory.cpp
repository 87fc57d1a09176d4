#include "memory.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace flashattn::cli {
namespace {

std::atomic<int64_t> g_live{0}, g_peak{0};

// Every block carries its size just below the pointer handed out, so unsized delete can subtract
// it. 16 bytes keep malloc's alignment for ordinary new.
constexpr size_t kHeader = 16;

void* counted_alloc(size_t n, size_t align) noexcept {
  const size_t front = std::max(align, kHeader);
  void* raw = nullptr;
  if (align <= kHeader) {
    raw = std::malloc(n + front);
  } else if (posix_memalign(&raw, align, n + front) != 0) {
    raw = nullptr;
  }
  if (!raw) return nullptr;
  char* user = static_cast<char*>(raw) + front;
  std::memcpy(user - sizeof(size_t), &n, sizeof(size_t));
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
                       static_cast<int64_t>(n);
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
  return user;
}

void counted_free(void* p, size_t align) noexcept {
  if (!p) return;
  char* user = static_cast<char*>(p);
  size_t n;
  std::memcpy(&n, user - sizeof(size_t), sizeof(size_t));
  g_live.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  std::free(user - std::max(align, kHeader));
}

void* counted_new(size_t n, size_t align) {
  void* p = counted_alloc(n, align);
  if (!p) throw std::bad_alloc();
  return p;
}

// "VmRSS:" or "VmHWM:" of /proc/self/status in bytes, -1 when unreadable. C stdio only: this must
// not allocate through operator new while a measurement runs.
int64_t status_field(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  int64_t v = -1;
  const size_t len = std::strlen(key);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, len) == 0) {
      v = std::strtoll(line + len, nullptr, 10) * 1024;
      break;
    }
  std::fclose(f);
  return v;
}

bool reset_rss_peak() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

int64_t ru_maxrss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // kilobytes on Linux
}

}  // namespace

int64_t heap_live_bytes() { return g_live.load(); }
int64_t current_rss_bytes() { return status_field("VmRSS:"); }

void MemoryMeter::start() {
  heap_base_ = g_live.load();
  g_peak.store(heap_base_);
  rss_exact_ = reset_rss_peak() && status_field("VmHWM:") >= 0;
  rss_base_ = current_rss_bytes();
}

int64_t MemoryMeter::heap_extra() const { return std::max<int64_t>(0, g_peak.load() - heap_base_); }

int64_t MemoryMeter::rss_extra() const {
  const int64_t peak = rss_exact_ ? status_field("VmHWM:") : ru_maxrss_bytes();
  return std::max<int64_t>(0, peak - rss_base_);
}

}  // namespace flashattn::cli

// ---- the replaceable global allocation functions ---------------------------------------------
// Default visibility so that the shared library's references bind here even though the project
// builds with hidden visibility.
#define FLASHATTN_CLI_EXPORT __attribute__((visibility("default")))
using flashattn::cli::counted_free;
using flashattn::cli::counted_new;
namespace fc = flashattn::cli;

FLASHATTN_CLI_EXPORT void* operator new(size_t n) { return counted_new(n, 0); }
FLASHATTN_CLI_EXPORT void* operator new[](size_t n) { return counted_new(n, 0); }
FLASHATTN_CLI_EXPORT void* operator new(size_t n, const std::nothrow_t&) noexcept {
  return fc::counted_alloc(n, 0);
}
FLASHATTN_CLI_EXPORT void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  return fc::counted_alloc(n, 0);
}
FLASHATTN_CLI_EXPORT void* operator new(size_t n, std::align_val_t a) {
  return counted_new(n, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void* operator new[](size_t n, std::align_val_t a) {
  return counted_new(n, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return fc::counted_alloc(n, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return fc::counted_alloc(n, static_cast<size_t>(a));
}

FLASHATTN_CLI_EXPORT void operator delete(void* p) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete[](void* p) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete(void* p, size_t) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete[](void* p, size_t) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete(void* p, const std::nothrow_t&) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_free(p, 0); }
FLASHATTN_CLI_EXPORT void operator delete(void* p, std::align_val_t a) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void operator delete[](void* p, std::align_val_t a) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void operator delete(void* p, size_t, std::align_val_t a) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void operator delete[](void* p, size_t, std::align_val_t a) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void operator delete(void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
FLASHATTN_CLI_EXPORT void operator delete[](void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  counted_free(p, static_cast<size_t>(a));
}
