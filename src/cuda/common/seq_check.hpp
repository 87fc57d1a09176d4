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
// and the GPU never waits for the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/host/select.hpp"

namespace flashattn::cuda {

struct SeqCheckJob {
  Packing pk;             // the caller's arrays
  int64_t batch, max_q, max_k;
  int32_t* out;           // workspace: cu_q, cu_k, used_k copies, then the verdict (1 valid, 0 not)
  volatile int* host;     // pinned, mapped: 1 valid, 2 not (0: not written yet)
};

// A pinned, mapped verdict word and the event recorded after the kernel that writes it.
struct VerdictSlot {
  volatile int* host = nullptr;
  int* mapped = nullptr;
  cudaEvent_t event = nullptr;
};

// One packed call's check (backend.cu: forward_plan / backward_plan). The caller first refuses a
// stream under graph capture (refuse_capture: the host must wait for the verdict, and the refusal
// must come before anything is allocated); the constructor launches the check into `ws`
// (seq_check_bytes) and points `pk` at its copies; device_ok() is the verdict in the workspace.
// finish(), after the call's kernels are queued, waits for the check and throws validation's error
// when it failed. Destroyed without finish() (a later step threw), it still waits, so that the
// pinned verdict word is free for the next call.
class SeqCheck {
 public:
  SeqCheck(Packing& pk, const Shape& s, void* ws, cudaStream_t stream);
  // Throws Unsupported when `stream` is being captured into a CUDA graph.
  static void refuse_capture(cudaStream_t stream);
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
  VerdictSlot slot_;
  const int* ok_ = nullptr;
  bool done_ = false;
};

}  // namespace flashattn::cuda
