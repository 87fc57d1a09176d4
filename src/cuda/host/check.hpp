// Error handling of the CUDA backend: every CUDA call and launch is checked, and a failure becomes
// a flashattn::Error (Backend, or OutOfMemory for allocations) that the C ABI turns into a status
// and a message. Nothing here aborts.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what) {
  // A failed call also left e as the runtime's last error; cleared (when it is not sticky) so
  // that the next call's launch check does not report it as its own.
  (void)cudaGetLastError();
  const Status s = e == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Backend;
  throw Error(s, std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + " (" +
                     cudaGetErrorString(e) + ")");
}

#define FLASHATTN_CUDA_CHECK(expr)                                      \
  do {                                                                  \
    const cudaError_t flashattn_err_ = (expr);                          \
    if (flashattn_err_ != cudaSuccess) ::flashattn::cuda::throw_cuda(flashattn_err_, #expr); \
  } while (0)

// After a launch: configuration errors show up here (asynchronous faults show up at the next
// synchronising call of the caller, as with every CUDA library).
inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw_cuda(e, kernel);
}

// Raises `kernel`'s dynamic shared-memory limit to `smem` on the current device (above 48 KiB a
// kernel must opt in) unless an earlier call already did: the attribute is per function and
// device and stays set, and setting it on every launch cost host time before each (backend.cu).
// (It belongs to the device's primary context, as do the library's cached side streams and
// memory pools: a cudaDeviceReset while the library is in use invalidates all three.)
void ensure_smem_limit(const void* kernel, int smem);

// Whether `st` is being captured into a CUDA graph; a failed query counts as not (what follows
// then reports its own error).
inline bool capturing(cudaStream_t st) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return cs != cudaStreamCaptureStatusNone;
}

// Launches kernel<<<grid, threads, smem, stream>>>(args) with its dynamic shared-memory limit
// raised to `smem`, and checks both. (CUDA sources only: this header is never compiled as plain
// C++.)
template <class Kernel, class Args>
void launch_checked(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                    const Args& args, const char* name) {
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<grid, threads, smem, stream>>>(args);
  check_launch(name);
}

// launch_checked's launch, as a programmatic dependent launch when `pdl` (sm_90+): the kernel may
// start while the stream's previous kernel finishes, and must call dev::pdl_wait() before it
// reads anything that kernel writes (it returns once that kernel has completed and its memory is
// visible); the previous kernel lets it start early with dev::pdl_trigger(). Between a decoding
// step's few-microsecond kernels this hides the launch gap.
template <class Kernel, class Args>
void launch_checked_pdl(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const Args& args,
                        const char* name, bool pdl) {
  if (!pdl) return launch_checked(kernel, grid, threads, smem, stream, args, name);
  ensure_smem_limit(reinterpret_cast<const void*>(kernel), smem);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args);
  if (e != cudaSuccess) throw_cuda(e, name);
  check_launch(name);
}

// Blocks of `per` that cover n.
inline unsigned grid_blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace flashattn::cuda
