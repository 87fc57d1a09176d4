// Shared helpers of the GPU tests (test_cuda.cpp: float32, test_cuda16.cpp: float16/bfloat16):
// the GPU-present check, device buffers, and a Problem's device copy with NaN-poisoned outputs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "test_util.hpp"

namespace flashattn::test {

inline bool have_gpu() {
  static const bool ok = cuda_available();
  return ok;
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no usable CUDA device (or a build without CUDA)"

#define CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

}  // namespace flashattn::test

// The library's kernel-selection knobs (src/cuda/host/overrides.hpp), exported by developer builds
// (FLASHATTN_DEV_OVERRIDES, on wherever the tests are built); not part of the stable C ABI.
extern "C" int flashattn_dev_set_override(const char* name, const char* value);

namespace flashattn::test {

// Sets a kernel-selection override (a FLASHATTN_CUDA_* knob) for the lifetime of the scope (value
// nullptr: the library's choice), and back to the library's choice afterwards.
class EnvScope {
 public:
  EnvScope(const char* name, const char* value) : name_(name) {
    if (flashattn_dev_set_override(name, value) != 0)
      ADD_FAILURE() << name << " = " << (value ? value : "(unset)") << ": " << flashattn_last_error();
  }
  ~EnvScope() { (void)flashattn_dev_set_override(name_.c_str(), nullptr); }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  std::string name_;
};

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n, size_t pad = 0) : bytes(n) {
    if (cudaMalloc(&ptr, n + pad) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Device copies of a Problem's buffers (same byte layout), with views rebound to them.
// offset_elements shifts every base pointer by that many elements of the tensor's own dtype
// (1: 4 bytes for float32 and lse, 2 bytes for float16/bfloat16), breaking 16-byte alignment.
struct DeviceProblem {
  Problem& host;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  Tensor q, k, v, dout, out, lse, dq, dk, dv;

  explicit DeviceProblem(Problem& p, int offset_elements = 0) : host(p) {
    Tensor* views[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
    testing::HostTensor* hs[] = {&p.q, &p.k, &p.v, &p.dout, &p.out, &p.lse, &p.dq, &p.dk, &p.dv};
    for (int i = 0; i < 9; ++i) {
      bufs.push_back(std::make_unique<DeviceBuffer>(hs[i]->bytes.size(), 16));
      if (!bufs.back()->ptr) continue;
      char* base = static_cast<char*>(bufs.back()->ptr) +
                   offset_elements * dtype_size(hs[i]->view.dtype);
      *views[i] = testing::rebind(hs[i]->view, base, 0);
      if (i < 4) cudaMemcpy(base, hs[i]->bytes.data(), hs[i]->bytes.size(), cudaMemcpyHostToDevice);
    }
    poison();
  }
  bool ok() const {
    for (const auto& b : bufs)
      if (!b->ptr) return false;
    return true;
  }
  void poison() {
    for (Tensor* t : {&out, &lse, &dq, &dk, &dv}) cudaMemset(t->data, 0xff, bytes_of(*t));  // NaN
  }
  // Gradients only (a second backward reuses the forward's out and lse).
  void poison_grads() {
    for (Tensor* t : {&dq, &dk, &dv}) cudaMemset(t->data, 0xff, bytes_of(*t));
  }
  // The forward's outputs only (a second forward family is checked on the same problem).
  void poison_outputs() {
    for (Tensor* t : {&out, &lse}) cudaMemset(t->data, 0xff, bytes_of(*t));
  }
  size_t bytes_of(const Tensor& t) const {
    for (const testing::HostTensor* h : {&host.q, &host.k, &host.v, &host.dout, &host.out, &host.lse,
                                         &host.dq, &host.dk, &host.dv})
      if (h->view.ndim == t.ndim && h->view.shape[0] == t.shape[0] && h->view.shape[1] == t.shape[1] &&
          h->view.shape[2] == t.shape[2] && (t.ndim == 3 || h->view.shape[3] == t.shape[3]))
        return h->bytes.size();
    return 0;
  }
  void forward(const Options& o) { flashattn::forward(q, k, v, out, lse, o); }
  void backward(const Options& o) { flashattn::backward(q, k, v, out, dout, lse, dq, dk, dv, o); }
  // Copies the outputs back into the host problem.
  void download() {
    cudaDeviceSynchronize();
    const Tensor* d[] = {&out, &lse, &dq, &dk, &dv};
    testing::HostTensor* h[] = {&host.out, &host.lse, &host.dq, &host.dk, &host.dv};
    for (int i = 0; i < 5; ++i)
      cudaMemcpy(h[i]->bytes.data(), d[i]->data, h[i]->bytes.size(), cudaMemcpyDeviceToHost);
  }
  // True when the device inputs still hold exactly the host problem's bytes.
  bool inputs_unchanged() {
    cudaDeviceSynchronize();
    const Tensor* d[] = {&q, &k, &v, &dout};
    const testing::HostTensor* h[] = {&host.q, &host.k, &host.v, &host.dout};
    for (int i = 0; i < 4; ++i) {
      std::vector<unsigned char> got(h[i]->bytes.size());
      cudaMemcpy(got.data(), d[i]->data, got.size(), cudaMemcpyDeviceToHost);
      if (got != h[i]->bytes) return false;
    }
    return true;
  }
};

}  // namespace flashattn::test
