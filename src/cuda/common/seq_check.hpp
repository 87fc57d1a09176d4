// The check of a packed call's sequence arrays on the device (Packing::unchecked: validation left
// the contents of device-resident cu_seqlens / seqused_k unread). Reading them on the host would
// stop the GPU at every call - a copy and a stream synchronisation before the host can launch
// anything; measured, 17 us of idle GPU per call at 28 sequences (docs/perf-log/varlen.md).
// Instead one small kernel applies validation's rules (core/validate.hpp, check_sequence_values)
// on the stream and writes the kernels' copies of the arrays - all zeros when a rule is broken,
// so that every sequence is empty and no kernel writes an output - and its verdict both into the
// workspace (for the backward's flat row passes, which do not go by sequence) and into pinned host
// memory. The host queues the call's kernels first and only then waits for the verdict: the
// error, when there is one, is the same InvalidArgument as before, raised with nothing written,
// and the GPU never waits for the host. Under CUDA graph capture there is no host to wait: the
// check is captured with the kernels, and a replay whose arrays break a rule writes nothing and
// counts a failure on the device instead (take_captured_failures reads the count).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/params.hpp"
#include "cuda/host/check.hpp"
#include "cuda/host/select.hpp"

namespace flashattn::cuda {

struct SeqCheckJob {
  Packing pk;             // the caller's arrays
  int64_t batch, max_q, max_k;
  int32_t* out;           // workspace: cu_q, cu_k, used_k copies, then the verdict (1 valid, 0 not)
  volatile int* host;     // pinned, mapped: 1 valid, 2 not (0: not written yet); nullptr: captured
                          // (a failure adds 1 to the device's count instead)
};

// The device's count of captured checks (packed sequence arrays, KV-cache index arrays: the check
// kernels of both live in seq_check.cu, beside the count, a variable of this module) that failed
// in a graph replay since the last call, on the current device. Waits for the device's work,
// returns the count and resets it (the C ABI's flashattn_cuda_take_check_failures). The read and
// the reset are two copies: a replay another thread launches between them is not counted, and the
// device-wide wait is not for a thread whose own capture is in progress.
int64_t take_captured_failures();

// A pinned, mapped verdict word and an event for the stream's progress.
struct VerdictSlot {
  volatile int* host = nullptr;
  int* mapped = nullptr;
  cudaEvent_t event = nullptr;
};

// A verdict word a call's own check kernel writes into pinned, mapped host memory: the host waits
// for it once the call's other kernels are queued. Nothing of the host's goes into the stream
// between the check and the kernels after it (an event recorded there kept the next kernel from
// starting early as a programmatic dependent launch: the decode step's kernels wait for the check
// anyway, the launch latency need not be added): wait() records its event after the call's last
// kernel and reads the word until it is written, the event telling a check that never ran (an
// earlier error) from one still to come. Slots come from a pool per device, reused call after
// call; one is a call's from its construction to its wait() (or destruction, which waits for the
// stream, so that a later call never sees this call's write).
class PendingVerdict {
 public:
  PendingVerdict();  // on the current device; the word set to 0 (not written)
  ~PendingVerdict();
  PendingVerdict(const PendingVerdict&) = delete;
  PendingVerdict& operator=(const PendingVerdict&) = delete;
  volatile int* device_word() const;  // for the kernel
  // The writer kernel was queued on `stream` (the destructor waits for it there).
  void launched(cudaStream_t stream) {
    stream_ = stream;
    launched_ = true;
  }
  // Once the call's kernels are queued on the writer's stream: returns the word as soon as the
  // check has written it (1 valid, 2 not), or 0 when the stream got past the check without a
  // write; the slot is given back. Throws when the stream reports an error (the slot is kept
  // unless the stream then completes: abandon()).
  int wait();
  // The writer's launch failed (it may be queued all the same): waits for the stream, gives the
  // slot back.
  void abandon(cudaStream_t stream);

 private:
  int device_ = 0;
  VerdictSlot slot_;
  cudaStream_t stream_ = nullptr;
  bool held_ = false;
  bool launched_ = false;
};

// A check kernel's launch with its verdict (the packed check, the KV-cache index check):
// launch(host word) queues the kernel; unless `stream` is being captured, `verdict` takes a slot
// first (the word); captured, the word is nullptr and nothing will wait (a failing replay counts
// on the device). A failed launch abandons the slot (the kernel may be queued all the same: a
// launch check can report an earlier error).
template <class Launch>
void launch_with_verdict(std::optional<PendingVerdict>& verdict, cudaStream_t stream, Launch&& launch) {
  if (!capturing(stream)) verdict.emplace();
  try {
    launch(verdict ? verdict->device_word() : nullptr);
  } catch (...) {
    if (verdict) verdict->abandon(stream);
    throw;
  }
  if (verdict) verdict->launched(stream);
}

// One packed call's check (backend.cu: forward_plan / backward_plan). The constructor launches the
// check into `ws` (seq_check_bytes) and points `pk` at its copies; device_ok() is the verdict in
// the workspace. finish(), after the call's kernels are queued, waits for the check and throws
// validation's error when it failed. Destroyed without finish() (a later step threw), it still
// waits, so that the pinned verdict word is free for the next call. On a stream under capture
// nothing is waited for (a failing replay counts on the device: take_captured_failures).
class SeqCheck {
 public:
  SeqCheck(Packing& pk, const Shape& s, void* ws, cudaStream_t stream);
  ~SeqCheck();
  SeqCheck(const SeqCheck&) = delete;
  SeqCheck& operator=(const SeqCheck&) = delete;
  const int* device_ok() const { return ok_; }
  void finish();

 private:
  Packing user_;  // the caller's arrays (for the error message)
  Shape shape_;
  cudaStream_t stream_;
  int device_ = 0;
  std::optional<PendingVerdict> verdict_;  // none under capture
  const int* ok_ = nullptr;
  bool done_ = false;
};

}  // namespace flashattn::cuda
