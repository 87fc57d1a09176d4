// The interface every backend implements. api.cpp validates, builds the params and calls exactly
// one backend; a backend reports problems it cannot serve by throwing Error(Status::Unsupported).
#pragma once

#include <cstddef>
#include <string>

#include "core/params.hpp"

namespace flashattn {
namespace cpu {
void forward(const ForwardParams& p);
void backward(const BackwardParams& p);
// KV-cache forward: the append (and rotary) first, then the attention of p.fwd.
void forward_kvcache(const KvcacheParams& p);
std::string describe();  // ISA chosen at run time, threads, kernels
// A framework's team of threads for the CPU calls (flashattn_set_cpu_team_runner); run == nullptr:
// the backend's own pools.
using TeamBody = void (*)(void* arg, int32_t thread);
using TeamRunner = void (*)(void* ctx, int32_t threads, TeamBody body, void* arg);
void set_team_runner(TeamRunner run, void* ctx);
}  // namespace cpu

namespace cuda {
bool built();      // false when the library was built without CUDA
bool available();  // built() and a device is usable
void forward(const ForwardParams& p);
void backward(const BackwardParams& p);
// KV-cache forward (float16/bfloat16): the append (and rotary), then the attention over the caches.
void forward_kvcache(const KvcacheParams& p);
// The device scratch bytes each call would take (options.workspace_query): its plan's workspace.
uint64_t forward_workspace(const ForwardParams& p);
uint64_t backward_workspace(const BackwardParams& p);
uint64_t kvcache_workspace(const KvcacheParams& p);
std::string describe();
// Checks that ptr is memory of CUDA device `device` (cudaPointerGetAttributes); throws
// Error(InvalidArgument) naming `what` otherwise.
void check_device_pointer(const void* ptr, int32_t device, const char* what);
// Copies `bytes` from memory of CUDA device `device` to the host, ordered after the work queued on
// `stream` (cudaStream_t; nullptr = the default stream), and waits for it.
void copy_to_host(void* dst, const void* src, size_t bytes, int32_t device, void* stream);
// Whether KV-cache calls leave the contents of device-resident index arrays to the backend's
// check on the stream (KvCheck, the default: no copy and synchronisation before the launches, the
// host waits only for the check's event once the kernels are queued) instead of
// reading them on the host (FLASHATTN_CUDA_KV_CHECK=host, a developer knob).
bool kv_checks_on_device();
// Sets a kernel-selection override (cuda/host/overrides.hpp) in builds with FLASHATTN_DEV_OVERRIDES.
void set_override(const char* name, const char* value);
// The failed index checks of captured calls' graph replays on `device` since the last call (waits
// for the device; resets the count): flashattn::cuda_take_check_failures.
int64_t take_check_failures(int32_t device);
}  // namespace cuda
}  // namespace flashattn
