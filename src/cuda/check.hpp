// Error handling of the CUDA backend: every CUDA call and launch is checked, and a failure becomes
// a flashattn::Error (Backend, or OutOfMemory for allocations) that the C ABI turns into a status
// and a message. Nothing here aborts.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what) {
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

}  // namespace flashattn::cuda
