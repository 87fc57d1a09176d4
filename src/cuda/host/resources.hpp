// Device resources of one call: the scratch memory a plan asks for (Workspace, from the library's
// stream-ordered pool) and the side stream some kernels run work on beside the caller's stream.
// Both are released on the caller's stream on every path out of a call. Host code of backend.cu
// and the launchers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "core/params.hpp"
#include "cuda/host/check.hpp"

namespace flashattn::cuda {

// The library's stream-ordered memory pool on the current device (backend.cu): created on first
// use with no release threshold, so the pages of one call's scratch stay mapped for the next.
// (The device's default pool hands its pages back to the driver at every synchronisation; mapping
// the tf32 backward's 0.9 GB of operand copies again cost ~1.5 ms per call at S = 1k, about as
// much as the call's kernels, measured on an H200.) A private pool leaves the caller's default-pool
// settings alone; what it holds is at most the largest scratch of one call in flight per stream.
// nullptr instead when the pool does not exist yet and `stream` is being captured into a CUDA
// graph, where creating one is not permitted (a process whose first such call is captured): the
// caller then allocates from the device's current pool (cudaMallocAsync, capturable).
cudaMemPool_t workspace_pool(cudaStream_t stream);

// Device scratch of a call (a plan's workspace: D, the dQ accumulator, operand copies): stream-ordered
// memory from workspace_pool(), freed on the stream on every path out (also when a later step
// throws).
// With a caller's workspace (options.workspace, validated: device memory, aligned, no overlap) the
// plan's bytes come from it instead, nothing is allocated, and a workspace smaller than the plan's
// need is an InvalidArgument before anything runs.
class Workspace {
 public:
  Workspace(size_t bytes, cudaStream_t stream, const Exec& e) : stream_(stream) {
    if (e.workspace != nullptr) {
      if (e.workspace_bytes < bytes)
        throw Error(Status::InvalidArgument,
                    "options.workspace_bytes = " + std::to_string(e.workspace_bytes) + " is less than the " +
                        std::to_string(bytes) + " bytes of scratch this call needs (options.workspace_query gives it)");
      ptr_ = bytes > 0 ? e.workspace : nullptr;
      owned_ = false;
      return;
    }
    if (bytes == 0) return;
    cudaMemPool_t pool = workspace_pool(stream);
    if (pool != nullptr)
      FLASHATTN_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr_, bytes, pool, stream));
    else
      FLASHATTN_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~Workspace() {
    if (ptr_ != nullptr && owned_) (void)cudaFreeAsync(ptr_, stream_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* get() const { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  bool owned_ = true;
  cudaStream_t stream_;
};

// A second stream of the current device for work that runs beside the caller's stream inside one
// call (the float32 sm_90a backward: the preprocess, the Q/dO operand copies and the dK/dV pass,
// beside the K/V copies and the dQ pass): non-blocking, of the device's highest priority (its
// CTAs are placed before waiting ones of normal-priority streams, the caller's included), one per
// host thread and device with the events that fork and join it, created on first use and
// destroyed when the thread ends (backend.cu; creating three events per call cost host time
// before the first launch). Being one per thread, it orders the backward calls one host thread
// makes on different streams after each other (each call's caller stream joins it at the end);
// one side stream per caller stream would not.
struct SideSlot {
  enum { kFork, kJoin, kMark, kEvents };
  cudaStream_t stream = nullptr;
  cudaEvent_t ev[kEvents] = {};
};
const SideSlot& side_stream();
// Whether work may fork onto side_stream() from `main`: neither stream is being captured into a
// graph (a side stream that joined one capture stays in it until that capture ends, and cannot join
// another; captured calls keep all their work on the caller's stream).
bool side_stream_free(cudaStream_t main);

// Fork and join of side_stream() with the caller's stream: the side stream's work follows what the
// caller queued before the fork; join() (at the latest the destructor, so on every path out, before
// the scratch declared earlier is freed on the caller's stream) makes the caller's stream wait for
// it; mark() and wait_mark() in between let the caller's stream wait for the side stream's work
// up to the mark only (the rest goes on beside). Events, not host synchronisation; the thread's
// events are recorded again by every call (a wait takes the record made before it).
class SideStream {
 public:
  explicit SideStream(cudaStream_t main) : main_(main), slot_(side_stream()) {
    FLASHATTN_CUDA_CHECK(cudaEventRecord(slot_.ev[SideSlot::kFork], main_));
    FLASHATTN_CUDA_CHECK(cudaStreamWaitEvent(slot_.stream, slot_.ev[SideSlot::kFork], 0));
  }
  ~SideStream() {
    if (!joined_) {
      (void)cudaEventRecord(slot_.ev[SideSlot::kJoin], slot_.stream);
      (void)cudaStreamWaitEvent(main_, slot_.ev[SideSlot::kJoin], 0);
    }
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t get() const { return slot_.stream; }
  void mark() { FLASHATTN_CUDA_CHECK(cudaEventRecord(slot_.ev[SideSlot::kMark], slot_.stream)); }
  void wait_mark() { FLASHATTN_CUDA_CHECK(cudaStreamWaitEvent(main_, slot_.ev[SideSlot::kMark], 0)); }
  void join() {
    FLASHATTN_CUDA_CHECK(cudaEventRecord(slot_.ev[SideSlot::kJoin], slot_.stream));
    FLASHATTN_CUDA_CHECK(cudaStreamWaitEvent(main_, slot_.ev[SideSlot::kJoin], 0));
    joined_ = true;
  }

 private:
  cudaStream_t main_;
  const SideSlot& slot_;
  bool joined_ = false;
};

}  // namespace flashattn::cuda
