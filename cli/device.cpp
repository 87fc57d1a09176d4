#include "device.hpp"

#ifndef FLASHATTN_CLI_CUDA
#define FLASHATTN_CLI_CUDA 0
#endif

#include "common.hpp"

#if FLASHATTN_CLI_CUDA
#include <cuda_runtime.h>
#endif

namespace flashattn::cli {

#if FLASHATTN_CLI_CUDA
namespace {
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(e == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Backend,
                std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
}  // namespace
#endif

bool cli_built_with_cuda() { return FLASHATTN_CLI_CUDA != 0; }

DeviceProblem::DeviceProblem(testing::Problem& problem, int32_t device)
    : p_(problem), device_(device) {
  testing::HostTensor* host[] = {&p_.q, &p_.k, &p_.v, &p_.dout, &p_.out,
                                 &p_.lse, &p_.dq, &p_.dk, &p_.dv};
  Tensor* views[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
  alibi = p_.alibi.view;
  if (device < 0) {
    for (int i = 0; i < 9; ++i) *views[i] = host[i]->view;
    return;
  }
#if FLASHATTN_CLI_CUDA
  check_cuda(cudaSetDevice(device), ("cudaSetDevice(" + std::to_string(device) + ")").c_str());
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = s;
  try {
    for (int i = 0; i < 9; ++i) {
      void* d = nullptr;
      const size_t bytes = host[i]->bytes.size();
      check_cuda(cudaMalloc(&d, bytes), ("cudaMalloc(" + fmt_bytes(static_cast<double>(bytes)) + ")").c_str());
      allocations_.push_back(d);
      // Outputs go over too: the NaN poison must reach the device so an unwritten element shows.
      check_cuda(cudaMemcpy(d, host[i]->bytes.data(), bytes, cudaMemcpyHostToDevice),
                 "cudaMemcpy host to device");
      *views[i] = testing::rebind(host[i]->view, d, device);
    }
    if (p_.alibi.view.ndim > 0) {
      void* d = nullptr;
      const size_t bytes = p_.alibi.bytes.size();
      check_cuda(cudaMalloc(&d, bytes), "cudaMalloc (ALiBi slopes)");
      allocations_.push_back(d);
      check_cuda(cudaMemcpy(d, p_.alibi.bytes.data(), bytes, cudaMemcpyHostToDevice),
                 "cudaMemcpy host to device");
      alibi = testing::rebind(p_.alibi.view, d, device);
    }
  } catch (...) {
    for (void* d : allocations_) cudaFree(d);
    cudaStreamDestroy(s);
    throw;
  }
#else
  throw Error(Status::Unsupported,
              "device " + device_string(device) +
                  ": this flashattn tool was built without CUDA (FLASHATTN_CUDA=OFF or no nvcc)");
#endif
}

DeviceProblem::~DeviceProblem() {
#if FLASHATTN_CLI_CUDA
  for (void* d : allocations_) cudaFree(d);
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

void DeviceProblem::synchronize() {
#if FLASHATTN_CLI_CUDA
  if (device_ >= 0)
    check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
#endif
}

void DeviceProblem::download_outputs() {
#if FLASHATTN_CLI_CUDA
  if (device_ < 0) return;
  synchronize();
  testing::HostTensor* host[] = {&p_.out, &p_.lse, &p_.dq, &p_.dk, &p_.dv};
  const Tensor* views[] = {&out, &lse, &dq, &dk, &dv};
  for (int i = 0; i < 5; ++i)
    check_cuda(cudaMemcpy(host[i]->bytes.data(), views[i]->data, host[i]->bytes.size(),
                          cudaMemcpyDeviceToHost),
               "cudaMemcpy device to host");
#endif
}

Timer::Timer(int32_t device, void* stream) : device_(device), stream_(stream) {
#if FLASHATTN_CLI_CUDA
  if (device_ >= 0)
    for (void*& e : events_) {
      cudaEvent_t ev = nullptr;
      check_cuda(cudaEventCreate(&ev), "cudaEventCreate");
      e = ev;
    }
#endif
}

Timer::~Timer() {
#if FLASHATTN_CLI_CUDA
  for (void* e : events_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
#endif
}

void Timer::start() {
#if FLASHATTN_CLI_CUDA
  if (device_ >= 0) {
    check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(events_[0]),
                               static_cast<cudaStream_t>(stream_)),
               "cudaEventRecord");
    return;
  }
#endif
  t0_ = now_seconds();
}

double Timer::stop_ms() {
#if FLASHATTN_CLI_CUDA
  if (device_ >= 0) {
    auto e0 = static_cast<cudaEvent_t>(events_[0]), e1 = static_cast<cudaEvent_t>(events_[1]);
    check_cuda(cudaEventRecord(e1, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    return ms;
  }
#endif
  return (now_seconds() - t0_) * 1e3;
}

std::vector<std::string> cuda_device_lines() {
  std::vector<std::string> lines;
#if FLASHATTN_CLI_CUDA
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    lines.push_back(std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")");
    return lines;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    lines.push_back("cuda:" + std::to_string(i) + "  " + prop.name + ", sm_" +
                    std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
                    std::to_string(prop.multiProcessorCount) + " SMs, " +
                    fmt_bytes(static_cast<double>(prop.totalGlobalMem)));
  }
  if (n == 0) lines.push_back("no CUDA device");
#else
  lines.push_back("this flashattn tool was built without CUDA");
#endif
  return lines;
}

}  // namespace flashattn::cli
