// A Problem's tensors on the device that runs it. On the CPU the views are the Problem's own host
// buffers; on CUDA (when the CLI is built with it) device buffers of the same byte layout are
// allocated, the inputs and the NaN-poisoned outputs copied over, and a stream created.
#pragma once

#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"

namespace flashattn::cli {

class DeviceProblem {
 public:
  DeviceProblem(testing::Problem& problem, int32_t device);
  ~DeviceProblem();
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  Tensor q, k, v, dout, out, lse, dq, dk, dv;
  Tensor alibi;  // the problem's ALiBi slopes on the device (ndim 0 when it has none)
  int32_t device() const { return device_; }
  void* stream() const { return stream_; }
  void synchronize();
  void download_outputs();  // device -> the Problem's out, lse, dq, dk, dv (no-op on the CPU)

 private:
  testing::Problem& p_;
  int32_t device_;
  void* stream_ = nullptr;
  std::vector<void*> allocations_;
};

// Wall time of a stretch of calls: steady_clock on the CPU, CUDA events on the problem's stream.
class Timer {
 public:
  Timer(int32_t device, void* stream);
  ~Timer();
  void start();
  double stop_ms();  // waits for the device

 private:
  int32_t device_;
  void* stream_;
  double t0_ = 0;
  void* events_[2] = {nullptr, nullptr};
};

bool cli_built_with_cuda();
// One line per CUDA device (name, compute capability, memory), or why there are none.
std::vector<std::string> cuda_device_lines();

}  // namespace flashattn::cli
