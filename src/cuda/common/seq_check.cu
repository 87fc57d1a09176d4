// The device-side check of a packed call's sequence arrays (seq_check.hpp).
#include "cuda/common/seq_check.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {
namespace dev {

// Failed checks in graph replays, per device (this module's copy on each): the check kernels of
// captured calls add to it (they have no host to report to), take_captured_failures reads it.
__device__ int g_captured_failures = 0;

// A check's verdict, by its thread 0: into the call's pinned word (1 valid, 2 not), or, captured
// (host nullptr: no host waits), a failure into the device's count.
__device__ __forceinline__ void publish_verdict(volatile int* host, bool ok) {
  if (host != nullptr) {
    *host = ok ? 1 : 2;
    // Pushed out to the host's memory now: without the fence the store may wait in the GPU's
    // caches until the call's kernels end, and the host, which reads the word until it changes,
    // then waits for the whole call instead of the check: no launch of the next call overlaps
    // this one's kernels.
    __threadfence_system();
  } else if (!ok) {
    atomicAdd(&g_captured_failures, 1);
  }
}

constexpr int kSeqCheckThreads = 1024;

// One CTA: every thread checks its entries of the arrays against validation's rules
// (check_sequence_values: cu[0] = 0, non-decreasing, each length within max_seqlen, cu[B] = the
// packed rows, 0 <= seqused_k[b] <= the sequence's keys), the CTA agrees on one verdict, then
// writes the copies (zeros when invalid) and the verdict.
__global__ void __launch_bounds__(kSeqCheckThreads) seq_check_kernel(const __grid_constant__ SeqCheckJob j) {
  const int64_t B = j.batch;
  const Packing& pk = j.pk;
  bool bad = false;
  for (int64_t i = threadIdx.x; i <= B; i += kSeqCheckThreads) {
    const int32_t q = pk.cu_q[i], k = pk.cu_k[i];
    if (i == 0) bad |= q != 0 || k != 0;
    if (i == B) bad |= q != pk.total_q || k != pk.total_k;
    if (i < B) {
      const int64_t nq = int64_t{pk.cu_q[i + 1]} - q, nk = int64_t{pk.cu_k[i + 1]} - k;
      bad |= nq < 0 || nq > j.max_q || nk < 0 || nk > j.max_k;
      if (pk.used_k != nullptr) bad |= pk.used_k[i] < 0 || pk.used_k[i] > nk;
    }
  }
  const bool ok = __syncthreads_or(bad) == 0;
  int32_t* cq = j.out;
  int32_t* ck = cq + B + 1;
  int32_t* used = ck + B + 1;
  for (int64_t i = threadIdx.x; i <= B; i += kSeqCheckThreads) {
    cq[i] = ok ? pk.cu_q[i] : 0;
    ck[i] = ok ? pk.cu_k[i] : 0;
    if (pk.used_k != nullptr && i < B) used[i] = ok ? pk.used_k[i] : 0;
  }
  if (threadIdx.x == 0) {
    used[B] = ok ? 1 : 0;
    publish_verdict(j.host, ok);
  }
}

// The index rules of check_kv_index_values (core/validate.cpp; both through KvCheck's predicates,
// core/params.hpp), entry by entry over one CTA, then one verdict: cache_seqlens in [0, capacity - S_new] and within int32 with S_new; cache_leftpad
// in [0, cache_seqlens]; cache_batch_idx in [0, B_cache) and, when appending, without repeats;
// the block-table entries of each sequence's used pages in [0, num_blocks); the rotary tables
// long enough for the last position used.
constexpr int kKvCheckThreads = 1024;
__global__ void __launch_bounds__(kKvCheckThreads) kv_check_kernel(const __grid_constant__ KvCheckJob j) {
  pdl_trigger();  // (the next kernel of the call may start: it waits for this one's completion)
  const KvCheck& f = j.f;
  const int64_t B = f.batch;
  bool bad = false;
  for (int64_t b = threadIdx.x; b < B; b += kKvCheckThreads) {
    const int64_t sl = f.cache_seqlens[b];
    bad |= !f.fits(sl, j.s_new) || !KvCheck::positions_fit(sl, j.s_new);
    if (f.start != nullptr) bad |= !KvCheck::start_ok(f.start[b], sl);
    if (f.batch_row != nullptr) {
      const int32_t r = f.batch_row[b];
      bad |= !f.row_ok(r);
      if (j.append)
        for (int64_t c = b + 1; c < B; ++c) bad |= f.batch_row[c] == r;
    }
    bad |= !f.rotary_ok(sl);
  }
  // Pages: the entries of each sequence's used pages only (entries past them are never read),
  // a sequence per thread.
  if (f.table != nullptr)
    for (int64_t b = threadIdx.x; b < B; b += kKvCheckThreads) {
      const int64_t sl = f.cache_seqlens[b];
      if (!f.fits(sl, j.s_new)) continue;  // (already bad)
      const int64_t used = f.pages_used(sl, j.s_new);
      const int32_t* row = f.table + b * f.table_stride;
      for (int64_t i = 0; i < used && i < f.max_blocks; ++i) bad |= !f.row_ok(row[i]);
    }
  const bool ok = __syncthreads_or(bad) == 0;
  int32_t* seqlen_k = j.out;
  int32_t* first_new = seqlen_k + B;
  int32_t* pos0 = first_new + B;
  for (int64_t b = threadIdx.x; b < B; b += kKvCheckThreads) {
    const int32_t sl = f.cache_seqlens[b], st = f.start != nullptr ? f.start[b] : 0;
    seqlen_k[b] = ok ? static_cast<int32_t>(sl + j.s_new - st) : 0;
    first_new[b] = ok ? sl - st : 0;
    pos0[b] = ok ? sl : 0;
  }
  if (threadIdx.x == 0) {
    pos0[B] = ok ? 1 : 0;
    publish_verdict(j.host, ok);
  }
}

}  // namespace dev

void launch_kv_check(const KvCheckJob& j, cudaStream_t stream) {
  launch_checked(dev::kv_check_kernel, dim3(1), dev::kKvCheckThreads, 0, stream, j, "KV-cache index check launch");
}

int64_t take_captured_failures() {
  int n = 0;
  const int zero = 0;
  FLASHATTN_CUDA_CHECK(cudaDeviceSynchronize());
  FLASHATTN_CUDA_CHECK(cudaMemcpyFromSymbol(&n, dev::g_captured_failures, sizeof(int)));
  FLASHATTN_CUDA_CHECK(cudaMemcpyToSymbol(dev::g_captured_failures, &zero, sizeof(int)));
  return n;
}

namespace {

// Pinned, mapped verdict words and their events, per device, reused call after call (a slot is
// one call's from its check to its finish()). Slots are never freed: at most as many exist as
// calls were ever in flight at once, and they outlive the runtime's teardown.
std::mutex slots_mutex;
std::map<int, std::vector<VerdictSlot>>& free_slots() {
  static auto* s = new std::map<int, std::vector<VerdictSlot>>;
  return *s;
}
VerdictSlot take_slot(int device) {
  {
    const std::lock_guard<std::mutex> lock(slots_mutex);
    std::vector<VerdictSlot>& free = free_slots()[device];
    if (!free.empty()) {
      const VerdictSlot s = free.back();
      free.pop_back();
      return s;
    }
  }
  VerdictSlot s;
  void* h = nullptr;
  FLASHATTN_CUDA_CHECK(cudaHostAlloc(&h, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  s.host = static_cast<volatile int*>(h);
  void* d = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&d, h, 0);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    (void)cudaFreeHost(h);
    throw_cuda(e, "the pinned word of a packed call's sequence check");
  }
  s.mapped = static_cast<int*>(d);
  return s;
}
void give_slot(int device, const VerdictSlot& s) {
  const std::lock_guard<std::mutex> lock(slots_mutex);
  free_slots()[device].push_back(s);
}

}  // namespace

PendingVerdict::PendingVerdict() {
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device_));
  slot_ = take_slot(device_);
  held_ = true;
  *slot_.host = 0;
}

PendingVerdict::~PendingVerdict() {
  if (!held_) return;
  // (Not waited for: an exception after the launch. The check may still write the word.)
  const cudaError_t e = launched_ ? cudaStreamSynchronize(stream_) : cudaSuccess;
  (void)cudaGetLastError();
  if (e == cudaSuccess) give_slot(device_, slot_);
}

volatile int* PendingVerdict::device_word() const { return slot_.mapped; }

// (A slot whose writer may still be pending - the wait failed - is not given back: leaked, so
// that a late write never lands in a later call's word.)
void PendingVerdict::abandon(cudaStream_t stream) {
  if (!held_) return;
  const cudaError_t e = cudaStreamSynchronize(stream);
  (void)cudaGetLastError();
  if (e == cudaSuccess) give_slot(device_, slot_);
  held_ = false;
}

int PendingVerdict::wait() {
  cudaError_t e = cudaEventRecord(slot_.event, stream_);
  // The word, read until written; every 32 reads the event says whether the stream is past the
  // check (then the word is final: 0 when the check never ran). After a millisecond (much work
  // queued before the check) the thread waits for the event as the runtime's scheduling flags
  // say (a blocking wait where the application asked for one) instead of spinning on.
  int word = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int spin = 0; e == cudaSuccess; ++spin) {
    word = *slot_.host;
    if (word != 0) break;
    if (spin % 32 == 31) {
      const bool waited = std::chrono::steady_clock::now() - start > std::chrono::milliseconds(1);
      e = waited ? cudaEventSynchronize(slot_.event) : cudaEventQuery(slot_.event);
      if (e == cudaSuccess) {
        word = *slot_.host;
        break;
      }
      if (e == cudaErrorNotReady) e = cudaSuccess;
    }
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    abandon(stream_);
    throw_cuda(e, "waiting for a check's verdict");
  }
  // (Written once, by the check: no later write can land in the word, so the slot is free even
  // though the stream may still run the call's kernels.)
  give_slot(device_, slot_);
  held_ = false;
  return word;
}

SeqCheck::SeqCheck(Packing& pk, const Shape& s, void* ws, cudaStream_t stream)
    : user_(pk), shape_(s), stream_(stream) {
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device_));
  SeqCheckJob j;
  j.pk = pk;
  j.batch = s.batch;
  j.max_q = s.seq_q;
  j.max_k = s.seq_kv;
  j.out = static_cast<int32_t*>(ws);
  launch_with_verdict(verdict_, stream, [&](volatile int* host) {
    j.host = host;
    launch_checked(dev::seq_check_kernel, dim3(1), dev::kSeqCheckThreads, 0, stream, j, "seq_check kernel launch");
  });
  const int32_t* copies = j.out;
  pk.cu_q = copies;
  pk.cu_k = copies + s.batch + 1;
  pk.used_k = user_.used_k != nullptr ? copies + 2 * (s.batch + 1) : nullptr;
  pk.unchecked = false;
  ok_ = copies + 2 * (s.batch + 1) + s.batch;
}

SeqCheck::~SeqCheck() = default;

void SeqCheck::finish() {
  if (done_) return;
  done_ = true;
  if (!verdict_) return;  // (captured: nothing to wait for)
  const int verdict = verdict_->wait();
  if (verdict == 1) return;
  if (verdict != 2)
    throw Error(Status::Backend, "the check of the sequence arrays (seq_check kernel) completed without a verdict (" +
                                     std::to_string(verdict) + ")");
  // Broken: the arrays read again for validation's own message (an error path: the copies wait).
  const int64_t B = shape_.batch;
  std::vector<int32_t> cq(static_cast<size_t>(B + 1)), ck(cq.size()), used;
  copy_to_host(cq.data(), user_.cu_q, cq.size() * 4, device_, stream_);
  copy_to_host(ck.data(), user_.cu_k, ck.size() * 4, device_, stream_);
  if (user_.used_k != nullptr) {
    used.resize(static_cast<size_t>(B));
    copy_to_host(used.data(), user_.used_k, used.size() * 4, device_, stream_);
  }
  check_sequence_values(cq.data(), ck.data(), used.empty() ? nullptr : used.data(), B, user_.total_q, user_.total_k,
                        shape_.seq_q, shape_.seq_kv);
  throw Error(Status::InvalidArgument,
              "cu_seqlens_q, cu_seqlens_k or seqused_k failed the check of their contents on the device "
              "(verdict " + std::to_string(verdict) + ") but passed when read again: were they written during "
              "the call? Nothing was written.");
}

}  // namespace flashattn::cuda
