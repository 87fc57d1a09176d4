// The C++ API: validate, build params, hand them to exactly one backend.
#include <sstream>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn {

Error::Error(Status status, const std::string& message)
    : std::runtime_error(message), status_(status) {}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Float64: return 8;
    case DType::Int32: return 4;
  }
  return 1;  // unknown codes are rejected by validation before sizes matter
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
  }
  return "unknown";
}

const char* mask_name(Mask mask) {
  switch (mask) {
    case Mask::None: return "none";
    case Mask::CausalTopLeft: return "causal_top_left";
    case Mask::CausalBottomRight: return "causal_bottom_right";
  }
  return "unknown";
}

Tensor Tensor::contiguous(void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                          int32_t device) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = 4;
  int64_t s[4] = {d0, d1, d2, d3};
  int64_t st = 1;
  for (int i = 3; i >= 0; --i) {
    t.shape[i] = s[i];
    t.stride[i] = st;
    st *= s[i];
  }
  return t;
}

Tensor Tensor::lse(float* data, int64_t d0, int64_t d1, int64_t d2, int32_t device) {
  Tensor t;
  t.data = data;
  t.dtype = DType::Float32;
  t.device = device;
  t.ndim = 3;
  t.shape[0] = d0;
  t.shape[1] = d1;
  t.shape[2] = d2;
  t.stride[2] = 1;
  t.stride[1] = d2;
  t.stride[0] = d1 * d2;
  return t;
}

Tensor Tensor::bshd(void* data, DType dtype, int64_t b, int64_t h, int64_t s, int64_t d,
                    int32_t device) {
  Tensor t = contiguous(data, dtype, b, h, s, d, device);
  t.stride[3] = 1;
  t.stride[1] = d;
  t.stride[2] = h * d;
  t.stride[0] = s * h * d;
  return t;
}

namespace {

// options.max_flops against the call's dense FLOP count (flashattn_options), after validation and
// before anything is written; then options.cancel, once (the CPU backend polls it per task too).
void check_bounds(const Shape& s, bool backward, const Options& o, const Exec& e) {
  if (o.max_flops > 0.0) {
    const double f = 4.0 * static_cast<double>(s.batch) * static_cast<double>(s.heads_q) *
                     static_cast<double>(s.seq_q) * static_cast<double>(s.seq_kv) *
                     static_cast<double>(s.head_dim) * (backward ? 2.5 : 1.0);
    if (f > o.max_flops) {
      std::ostringstream os;
      os << "the call's work, " << f << " FLOPs (" << (backward ? "2.5 x " : "") << "4 * B " << s.batch << " * Hq "
         << s.heads_q << " * Sq " << s.seq_q << " * Skv " << s.seq_kv << " * D " << s.head_dim
         << "), exceeds options.max_flops = " << o.max_flops;
      throw Error(Status::InvalidArgument, os.str());
    }
  }
  if (e.cancel != nullptr && e.cancel(e.cancel_arg) != 0)
    throw Error(Status::Cancelled, "cancelled by options.cancel before the call started");
}


// options.workspace checked against the call's tensors; with options.workspace_query the call
// ends here: true after storing the scratch bytes `need()` gives (CUDA) or 0 (CPU).
template <class Need>
bool workspace_step(const Options& o, const Exec& e, std::vector<const Tensor*> tensors, Need&& need) {
  tensors.push_back(o.alibi_slopes);
  check_workspace(o, e.device, tensors);
  if (o.workspace_query == nullptr) return false;
  *o.workspace_query = e.device < 0 ? 0 : need();
  return true;
}

}  // namespace

void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
             const Tensor& lse, const Options& options) {
  ForwardParams p = make_forward_params(q, k, v, out, lse, options);
  check_bounds(p.shape, false, options, p.exec);
  if (workspace_step(options, p.exec, {&q, &k, &v, &out, &lse}, [&] { return cuda::forward_workspace(p); })) return;
  if (p.exec.device < 0)
    cpu::forward(p);
  else
    cuda::forward(p);
}

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
              const Tensor& dv, const Options& options) {
  BackwardParams p = make_backward_params(q, k, v, out, dout, lse, dq, dk, dv, options);
  check_bounds(p.shape, true, options, p.exec);
  if (workspace_step(options, p.exec, {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv},
                     [&] { return cuda::backward_workspace(p); }))
    return;
  if (p.exec.device < 0)
    cpu::backward(p);
  else
    cuda::backward(p);
}

void forward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const Varlen& varlen, const Options& options) {
  ForwardParams p = make_forward_params_varlen(q, k, v, out, lse, varlen, options);
  check_bounds(p.shape, false, options, p.exec);
  if (workspace_step(options, p.exec,
                     {&q, &k, &v, &out, &lse, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k},
                     [&] { return cuda::forward_workspace(p); }))
    return;
  if (p.exec.device < 0)
    cpu::forward(p);
  else
    cuda::forward(p);
}

void backward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                     const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Varlen& varlen,
                     const Options& options) {
  BackwardParams p = make_backward_params_varlen(q, k, v, out, dout, lse, dq, dk, dv, varlen, options);
  check_bounds(p.shape, true, options, p.exec);
  if (workspace_step(options, p.exec,
                     {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, varlen.cu_seqlens_q, varlen.cu_seqlens_k,
                      varlen.seqused_k},
                     [&] { return cuda::backward_workspace(p); }))
    return;
  if (p.exec.device < 0)
    cpu::backward(p);
  else
    cuda::backward(p);
}

void forward_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out,
                     const Tensor& lse, const KvCache& kv, const Options& options) {
  KvcacheCall call;
  make_kvcache_params(q, k_cache, v_cache, out, lse, kv, options, call);
  check_bounds(call.params.fwd.shape, false, options, call.params.fwd.exec);
  if (workspace_step(options, call.params.fwd.exec,
                     {&q, &k_cache, &v_cache, &out, &lse, kv.k_new, kv.v_new, kv.cache_seqlens, kv.cache_batch_idx,
                      kv.cache_leftpad, kv.block_table, kv.rotary_cos, kv.rotary_sin},
                     [&] { return cuda::kvcache_workspace(call.params); }))
    return;
  if (call.params.fwd.exec.device >= 0)
    cuda::forward_kvcache(call.params);
  else
    cpu::forward_kvcache(call.params);
}

bool cuda_available() { return cuda::available(); }
int64_t cuda_take_check_failures(int device) {
  if (device < 0) throw Error(Status::InvalidArgument, "device = " + std::to_string(device) + " must be >= 0");
  return cuda::take_check_failures(device);
}

std::string build_info() {
  std::ostringstream os;
  os << "flashattn " << FLASHATTN_VERSION_MAJOR << "." << FLASHATTN_VERSION_MINOR << "."
     << FLASHATTN_VERSION_PATCH << "\n";
  os << "cpu backend: " << cpu::describe() << "\n";
  os << "cuda backend: " << cuda::describe() << "\n";
  return os.str();
}

}  // namespace flashattn
