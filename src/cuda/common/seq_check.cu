// The device-side check of a packed call's sequence arrays (seq_check.hpp).
#include "cuda/common/seq_check.hpp"

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "cuda/host/check.hpp"

namespace flashattn::cuda {
namespace dev {

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
    *j.host = ok ? 1 : 2;
    __threadfence_system();
  }
}

}  // namespace dev

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

void SeqCheck::refuse_capture(cudaStream_t stream) {
  if (capturing(stream))
    throw Error(Status::Unsupported,
                "the stream is being captured into a CUDA graph, and a packed-batch call waits for the check of "
                "its sequence arrays (cu_seqlens, seqused_k) before it returns; capture dense calls only, or "
                "make these calls outside the capture");
}

SeqCheck::SeqCheck(Packing& pk, const Shape& s, void* ws, cudaStream_t stream)
    : user_(pk), shape_(s), stream_(stream) {
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device_));
  slot_ = take_slot(device_);
  *slot_.host = 0;
  SeqCheckJob j;
  j.pk = pk;
  j.batch = s.batch;
  j.max_q = s.seq_q;
  j.max_k = s.seq_kv;
  j.out = static_cast<int32_t*>(ws);
  j.host = slot_.mapped;
  try {
    launch_checked(dev::seq_check_kernel, dim3(1), dev::kSeqCheckThreads, 0, stream, j, "seq_check kernel launch");
    FLASHATTN_CUDA_CHECK(cudaEventRecord(slot_.event, stream));
  } catch (...) {
    // The kernel may be queued all the same (a launch check can report an earlier error, and the
    // event record fail after a good launch): the slot goes back only once it cannot be written.
    (void)cudaStreamSynchronize(stream);
    (void)cudaGetLastError();
    give_slot(device_, slot_);
    throw;
  }
  const int32_t* copies = j.out;
  pk.cu_q = copies;
  pk.cu_k = copies + s.batch + 1;
  pk.used_k = user_.used_k != nullptr ? copies + 2 * (s.batch + 1) : nullptr;
  pk.unchecked = false;
  ok_ = copies + 2 * (s.batch + 1) + s.batch;
}

SeqCheck::~SeqCheck() {
  if (done_) return;
  (void)cudaEventSynchronize(slot_.event);
  (void)cudaGetLastError();
  give_slot(device_, slot_);
}

void SeqCheck::finish() {
  if (done_) return;
  done_ = true;
  const cudaError_t e = cudaEventSynchronize(slot_.event);
  const int verdict = *slot_.host;
  give_slot(device_, slot_);
  if (e != cudaSuccess) throw_cuda(e, "waiting for the sequence arrays' check");
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
