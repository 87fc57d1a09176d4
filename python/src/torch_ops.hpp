// What the two parts of flashattn.torch's C++ eager path share: the ops (torch_ops.cpp, through
// PyTorch's dispatcher) and their direct Python entry (torch_fastcall.cpp, which calls the same
// forward without the dispatcher when nothing in the call needs it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace flashattn_torch {

// How the ops' tensors hold q, k and v: separately, or FlashAttention's packed qkv [B, S, 3, H, D]
// / kv [B, S, 2, Hkv, D] (gradients into one buffer laid out like the input, as flash_attn's).
enum Pack : int64_t { kSeparate = 0, kQkv = 1, kKv = 2 };

// The scalar options, in the ops' order (flashattn.torch._codes), plus the layout, the packed
// batch's lengths and where the CUDA scratch comes from.
struct Opts {
  double scale = 0.0;
  int64_t mask = 0, precision = 0, num_threads = 0;
  bool deterministic = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  bool bshd = false;          // [B, S, H, D] tensors (dims 1 and 2 swapped in the views)
  bool torch_scratch = true;  // CUDA scratch from torch's caching allocator
  int64_t pack = kSeparate;
  bool varlen = false;        // packed variable-length batch: 3-d q, k, v and cu_seqlens
  int64_t max_q = 0, max_k = 0;

  std::vector<int64_t> ints() const {
    return {mask, precision, num_threads, deterministic, window_left, window_right, bshd, torch_scratch, pack,
            varlen, max_q, max_k};
  }
  static Opts from(double scale, double softcap, const std::vector<int64_t>& i) {
    Opts o;
    o.scale = scale;
    o.softcap = softcap;
    o.mask = i[0];
    o.precision = i[1];
    o.num_threads = i[2];
    o.deterministic = i[3] != 0;
    o.window_left = i[4];
    o.window_right = i[5];
    o.bshd = i[6] != 0;
    o.torch_scratch = i[7] != 0;
    o.pack = i[8];
    o.varlen = i[9] != 0;
    o.max_q = i[10];
    o.max_k = i[11];
    return o;
  }
};

// The inputs a, b, c of a call: q, k, v (kSeparate, and varlen), qkv (kQkv) or q, kv (kKv);
// undefined where the packing has fewer.
struct Operands {
  at::Tensor a, b, c;
};

// A packed batch's sequence arrays (undefined unless varlen; used_k also when not given).
struct SeqTensors {
  at::Tensor cu_q, cu_k, used_k;
};

// The options of a call as the ops take them (num_threads checked against the library's bound).
Opts make_opts(double scale, int64_t mask, int64_t precision, int64_t num_threads, bool deterministic,
               int64_t window_left, int64_t window_right, double softcap, bool torch_scratch);

// A forward op's work at its Autograd key: (out, lse), with the autograd node recorded when grad
// mode is on and an input requires grad (as every forward op runs eagerly).
std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const Operands& in, const SeqTensors& sq,
                                                         const std::optional<at::Tensor>& slopes, const Opts& o);

// flashattn.torch's custom ops (flashattn::fwd, bwd, bshd_*, qkvpacked_*, kvpacked_*, varlen_*)
// get C++ kernels at the CPU and CUDA keys (on) or lose them (off: their Python implementations
// serve them); torch_scratch: where those kernels' CUDA scratch comes from.
void set_custom_kernels(bool on, bool torch_scratch);

}  // namespace flashattn_torch
