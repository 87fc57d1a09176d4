// The direct Python entry of flashattn.torch's eager forward ops: flashattn._torch_ops.forward(kind,
// *op_inputs, torch_scratch) runs what the op flashattn_eager::<kind> runs at its Autograd key
// (forward_with_autograd, torch_ops.cpp) without going through PyTorch's dispatcher, or returns
// None where the call needs the dispatcher, and flashattn.torch then calls the op.
//
// Why: from Python an op call parses its arguments against the schema, boxes them and walks the
// dispatch keys; at tiny shapes that is about a third of a forward's host time (bench/
// host_overhead.py: the op alone 10.2 us of flash_attn_func's 17.0 on the CPU, while an ATen op
// through the same Python path costs 2.3 us more than its direct binding). PyTorch's own Python
// bindings (torch.mul, F.scaled_dot_product_attention) call C++ directly too.
//
// When the dispatcher is needed, the result is None and nothing has run: a tensor that is not
// exactly a torch.Tensor (subclasses and their __torch_function__ / __torch_dispatch__), a tensor
// with a dispatch key beyond a dense CPU or CUDA tensor's (functorch wrappers, conjugate or
// negative views, meta, sparse, nested), a torch function or dispatch mode, any change of the
// thread's dispatch-key state (inference mode, autocast, functorch transforms, below-autograd
// guards), or an argument of another Python type than the op's schema takes (the op then reports
// it). Errors in the call itself are raised exactly as the op raises them (the same C++ checks,
// translated by PyTorch's own handler), and profilers see the call under the op's name.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/python_headers.h>

#include <optional>

#include "flashattn/flashattn.h"
#include "torch_ops.hpp"

namespace {

using namespace flashattn_torch;

// What each kind's op takes before its options (flashattn.torch's op order): data tensors, then
// for varlen the sequence arrays and their maxima.
enum Kind : long { kFwd = 0, kBshdFwd = 1, kQkvpackedFwd = 2, kKvpackedFwd = 3, kVarlenFwd = 4, kKinds };
constexpr int kDataTensors[kKinds] = {3, 3, 1, 2, 3};

// The dispatch keys of a dense CPU or CUDA tensor (its backend, autograd, in-place/view tracking,
// autocast): any other key needs the dispatcher.
const c10::DispatchKeySet kPlainKeys =
    c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCPU,
                         c10::DispatchKey::AutogradCUDA, c10::DispatchKey::ADInplaceOrView,
                         c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});

bool thread_state_is_plain() {
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  return tls.included_ == c10::default_included_set && tls.excluded_ == c10::default_excluded_set &&
         !at::impl::torch_function_mode_enabled() && !c10::impl::TorchDispatchModeTLS::any_modes_set();
}

// Argument parsing: false = not the type the schema takes (the op gets the call).
bool tensor_arg(PyObject* o, at::Tensor& t) {
  if (!THPVariable_CheckExact(o)) return false;
  t = THPVariable_Unpack(o);
  return (t.key_set().raw_repr() & ~kPlainKeys.raw_repr()) == 0;
}

bool optional_tensor_arg(PyObject* o, std::optional<at::Tensor>& t) {
  if (o == Py_None) return true;
  at::Tensor x;
  if (!tensor_arg(o, x)) return false;
  t = std::move(x);
  return true;
}

bool int_arg(PyObject* o, int64_t& v) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  v = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(v == -1 && PyErr_Occurred());
}

bool float_arg(PyObject* o, double& v) {
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
    return true;
  }
  int64_t i = 0;
  if (!int_arg(o, i)) return false;
  v = static_cast<double>(i);
  return true;
}

bool bool_arg(PyObject* o, bool& v) {
  if (!PyBool_Check(o)) return false;
  v = o == Py_True;
  return true;
}

// The GIL released for the call (as PyTorch releases it around an op), taken back on any exit.
struct ReleasedGil {
  PyThreadState* state = PyEval_SaveThread();
  ~ReleasedGil() { PyEval_RestoreThread(state); }
};

constexpr const char* kOpNames[kKinds] = {"flashattn_eager::fwd", "flashattn_eager::fwd", "flashattn_eager::qkvpacked_fwd",
                                          "flashattn_eager::kvpacked_fwd", "flashattn_eager::varlen_fwd"};

// The op's work for a parsed call: Autograd-key forward (C++ node, library call), the GIL released,
// under the op's name for profilers.
std::tuple<at::Tensor, at::Tensor> run(long kind, const Operands& in, const SeqTensors& sq,
                                       const std::optional<at::Tensor>& slopes, Opts o, int64_t max_q, int64_t max_k) {
  ReleasedGil no_gil;
  RECORD_FUNCTION(kOpNames[kind], std::vector<c10::IValue>());
  o.bshd = kind == kBshdFwd;
  o.pack = kind == kQkvpackedFwd ? kQkv : kind == kKvpackedFwd ? kKv : kSeparate;
  o.varlen = kind == kVarlenFwd;
  o.max_q = max_q;
  o.max_k = max_k;
  return forward_with_autograd(in, sq, slopes, o);
}

// What a call returns: the ops' (out, lse); flash_attn's out alone, or (out, lse, None) with
// return_attn_probs.
enum Returns { kPair, kOut, kOutLseNone };
PyObject* wrap(std::tuple<at::Tensor, at::Tensor> r, Returns what) {
  PyObject* out = THPVariable_Wrap(std::move(std::get<0>(r)));
  if (out == nullptr || what == kOut) return out;
  PyObject* lse = THPVariable_Wrap(std::move(std::get<1>(r)));
  if (lse == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  PyObject* t = what == kOutLseNone ? PyTuple_Pack(3, out, lse, Py_None) : PyTuple_Pack(2, out, lse);
  Py_DECREF(out);
  Py_DECREF(lse);
  return t;
}

// The data tensors of a call of `kind` from a[0..], then for varlen cu_seqlens_q, cu_seqlens_k,
// [seqused_k (with_used_k),] max_seqlen_q, max_seqlen_k. False (no Python error set) when one is
// not of its exact type: the caller returns None.
bool data_args(long kind, PyObject* const* a, bool with_used_k, Operands& in, SeqTensors& sq, int64_t& max_q,
               int64_t& max_k) {
  at::Tensor* data[3] = {&in.a, &in.b, &in.c};
  for (int i = 0; i < kDataTensors[kind]; ++i)
    if (!tensor_arg(a[i], *data[i])) return false;
  if (kind != kVarlenFwd) return true;
  PyObject* const* s = a + kDataTensors[kind];
  std::optional<at::Tensor> used_k;
  const bool ok = tensor_arg(s[0], sq.cu_q) && tensor_arg(s[1], sq.cu_k) &&
                  (!with_used_k || optional_tensor_arg(s[2], used_k)) && int_arg(s[2 + with_used_k], max_q) &&
                  int_arg(s[3 + with_used_k], max_k);
  if (!ok) {
    PyErr_Clear();
    return false;
  }
  if (used_k) sq.used_k = *used_k;
  return true;
}

// forward(kind, *inputs, torch_scratch) -> (out, lse), or None (the op must serve the call).
PyObject* forward(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 1 || !PyLong_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "flashattn._torch_ops.forward(kind, *inputs, torch_scratch)");
    return nullptr;
  }
  const long kind = PyLong_AsLong(args[0]);
  if (kind < 0 || kind >= kKinds) {
    PyErr_Format(PyExc_ValueError, "flashattn._torch_ops.forward: kind = %ld, expected 0..%d", kind, kKinds - 1);
    return nullptr;
  }
  const Py_ssize_t n_seq = kind == kVarlenFwd ? 5 : 0, n_lead = kDataTensors[kind] + n_seq;
  if (nargs != 1 + n_lead + 8 + 1 + 1) {
    PyErr_Format(PyExc_TypeError, "flashattn._torch_ops.forward: kind %ld takes %zd arguments after it, got %zd",
                 kind, n_lead + 10, nargs - 1);
    return nullptr;
  }
  if (!thread_state_is_plain()) Py_RETURN_NONE;

  PyObject* const* a = args + 1;
  Operands in;
  SeqTensors sq;
  int64_t max_q = 0, max_k = 0;
  if (!data_args(kind, a, true, in, sq, max_q, max_k)) Py_RETURN_NONE;
  PyObject* const* opt = a + n_lead;
  double scale = 0, softcap = 0;
  int64_t mask = 0, precision = 0, num_threads = 0, window_left = 0, window_right = 0;
  bool deterministic = false, torch_scratch = true;
  std::optional<at::Tensor> slopes;
  if (!float_arg(opt[0], scale) || !int_arg(opt[1], mask) || !int_arg(opt[2], precision) ||
      !int_arg(opt[3], num_threads) || !bool_arg(opt[4], deterministic) || !int_arg(opt[5], window_left) ||
      !int_arg(opt[6], window_right) || !float_arg(opt[7], softcap) || !optional_tensor_arg(opt[8], slopes) ||
      !bool_arg(opt[9], torch_scratch)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }

  return wrap(run(kind, in, sq, slopes,
                  make_opts(scale, mask, precision, num_threads, deterministic, window_left, window_right, softcap,
                            torch_scratch),
                  max_q, max_k),
              kPair);
  END_HANDLE_TH_ERRORS
}

// One of the strings `names` (exact str), as its index; -1 otherwise.
template <size_t N>
int string_arg(PyObject* o, const char* const (&names)[N]) {
  if (!PyUnicode_CheckExact(o)) return -1;
  for (size_t i = 0; i < N; ++i)
    if (PyUnicode_CompareWithASCIIString(o, names[i]) == 0) return static_cast<int>(i);
  return -1;
}

// Where float32 rounds a double to infinity (FLT_MAX and half an ulp).
constexpr double kFloat32Overflow = (2.0 - 0x1p-24) * 0x1p127;

// A scale as flashattn.torch takes it: None (0: the library's 1/sqrt(D)) or a float that float32
// keeps nonzero and finite (others: the Python function converts or refuses them; one that
// overflows float32 gets NumPy's overflow warning there).
bool scale_arg(PyObject* o, double& v) {
  if (o == Py_None) return true;
  if (!PyFloat_CheckExact(o)) return false;
  v = PyFloat_AS_DOUBLE(o);
  return static_cast<float>(v) != 0.0f && !(v >= kFloat32Overflow || v <= -kFloat32Overflow);
}

// A softcap float32 holds: 0 (none), or finite and in (2^-150, FLT_MAX rounded up).
bool softcap_ok(double cap) { return cap == 0 || (cap > 0x1p-150 && cap < kFloat32Overflow); }

// window_size as an exact tuple or list of two exact ints.
bool window_arg(PyObject* o, int64_t (&w)[2]) {
  if (!((PyTuple_CheckExact(o) || PyList_CheckExact(o)) && PySequence_Fast_GET_SIZE(o) == 2)) return false;
  return int_arg(PySequence_Fast_GET_ITEM(o, 0), w[0]) && int_arg(PySequence_Fast_GET_ITEM(o, 1), w[1]);
}

// attention(q, k, v, softmax_scale, mask, window_size, softcap, alibi_slopes, precision,
// num_threads, deterministic, return_lse, is_causal, scale, enable_gqa, torch_scratch):
// flashattn.torch.attention with its own arguments, for the calls whose arguments need no
// conversion (exact types; mask and precision among their names; SDPA's is_causal / scale /
// enable_gqa where they do not conflict; no empty sequence, which the Python function serves
// without the library). Returns attention()'s result, or None before anything ran: the Python
// function then serves the call (and raises its errors).
PyObject* attention(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 16) {
    PyErr_SetString(PyExc_TypeError,
                    "flashattn._torch_ops.attention(q, k, v, softmax_scale, mask, window_size, softcap, alibi_slopes, "
                    "precision, num_threads, deterministic, return_lse, is_causal, scale, enable_gqa, torch_scratch)");
    return nullptr;
  }
  if (!thread_state_is_plain()) Py_RETURN_NONE;
  Operands in;
  if (!tensor_arg(args[0], in.a) || !tensor_arg(args[1], in.b) || !tensor_arg(args[2], in.c)) Py_RETURN_NONE;
  if (in.a.dim() != 4 || in.b.dim() != 4 || in.c.dim() != 4 || in.a.size(2) == 0 || in.b.size(2) == 0)
    Py_RETURN_NONE;
  PyObject* const* opt = args + 3;
  static const char* const kMasks[] = {"none", "causal", "causal_top_left", "causal_bottom_right"};
  static const char* const kPrecisions[] = {"fp32", "tf32"};
  double scale = 0, sdpa_scale = 0, softcap = 0;
  int64_t w[2] = {0, 0}, num_threads = 0;
  bool deterministic = false, want_lse = false, causal = false, gqa = true, torch_scratch = true;
  std::optional<at::Tensor> slopes;
  const int mask = string_arg(opt[1], kMasks), precision = string_arg(opt[5], kPrecisions);
  if (!scale_arg(opt[0], scale) || mask < 0 || !window_arg(opt[2], w) || !float_arg(opt[3], softcap) ||
      !optional_tensor_arg(opt[4], slopes) || precision < 0 ||
      (opt[6] != Py_None && !int_arg(opt[6], num_threads)) || !bool_arg(opt[7], deterministic) ||
      !bool_arg(opt[8], want_lse) || (opt[9] != Py_None && !bool_arg(opt[9], causal)) ||
      !scale_arg(opt[10], sdpa_scale) || (opt[11] != Py_None && !bool_arg(opt[11], gqa)) ||
      !bool_arg(opt[12], torch_scratch)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  // What the Python function refuses: both scales, is_causal=True with a mask, differing head
  // counts without enable_gqa, window sides below -1, a softcap float32 cannot hold, a negative
  // thread count.
  if ((opt[0] != Py_None && opt[10] != Py_None) || (causal && mask != 0) || (!gqa && in.a.size(1) != in.b.size(1)) ||
      w[0] < -1 || w[1] < -1 || !(softcap >= 0) || !softcap_ok(softcap) || num_threads < 0)
    Py_RETURN_NONE;
  if (opt[10] != Py_None) scale = sdpa_scale;
  // mask: "causal" is FlashAttention's (bottom-right); is_causal=True SDPA's (top-left).
  const int64_t mask_code = causal || mask == 2 ? FLASHATTN_MASK_CAUSAL_TOP_LEFT
                            : mask == 0         ? FLASHATTN_MASK_NONE
                                                : FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  return wrap(run(kFwd, in, SeqTensors{}, slopes,
                  make_opts(scale, mask_code, precision == 0 ? FLASHATTN_PRECISION_FP32 : FLASHATTN_PRECISION_TF32,
                            num_threads, deterministic, w[0], w[1], softcap, torch_scratch),
                  0, 0),
              want_lse ? kPair : kOut);
  END_HANDLE_TH_ERRORS
}

// flash_attn(kind, *data, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
// deterministic, return_attn_probs, torch_scratch): flash_attn_func (kind 1: q, k, v),
// flash_attn_qkvpacked_func (2: qkv), flash_attn_kvpacked_func (3: q, kv) and
// flash_attn_varlen_func (4: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
// with their own arguments, for the calls whose arguments need no conversion: exact Python types, dropout_p 0,
// a scale that float32 keeps nonzero, a finite softcap float32 can hold, no ALiBi shift of the
// returned LSE. The options are normalised as flash_attn_interface does (window sides < 0 or
// >= seqlen_k unbounded, the right side free under causal, a negative softcap off) and the call
// runs as forward() runs it. Anything else returns None before anything has run, and the
// Python function serves the call (and raises its errors). Why: the Python glue around the op
// (argument checks, the options cache, call_op) cost ~2.6 us of an 8 us CPU forward.
PyObject* flash_attn(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const long kind = nargs >= 1 && PyLong_CheckExact(args[0]) ? PyLong_AsLong(args[0]) : -1;
  const Py_ssize_t n_seq = kind == kVarlenFwd ? 4 : 0;
  if (kind < kBshdFwd || kind > kVarlenFwd || nargs != 1 + kDataTensors[kind] + n_seq + 9) {
    PyErr_SetString(PyExc_TypeError,
                    "flashattn._torch_ops.flash_attn(kind 1..4, *data, [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                    "max_seqlen_k,] dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, "
                    "return_attn_probs, torch_scratch)");
    return nullptr;
  }
  if (!thread_state_is_plain()) Py_RETURN_NONE;
  PyObject* const* a = args + 1;
  Operands in;
  SeqTensors sq;
  int64_t max_q = 0, max_k = 0;
  if (!data_args(kind, a, false, in, sq, max_q, max_k)) Py_RETURN_NONE;
  // The dimensions the Python function checks (it names the tensor when they are wrong).
  const int64_t packed_dim = kind == kQkvpackedFwd ? 3 : 2;
  const at::Tensor& keys = kind == kQkvpackedFwd ? in.a : in.b;
  const bool dims_ok = kind == kBshdFwd     ? in.a.dim() == 4 && in.b.dim() == 4 && in.c.dim() == 4
                       : kind == kVarlenFwd ? in.a.dim() == 3 && in.b.dim() == 3 && in.c.dim() == 3
                                            : keys.dim() == 5 && keys.size(2) == packed_dim &&
                                                  (kind == kQkvpackedFwd || in.a.dim() == 4);
  if (!dims_ok) Py_RETURN_NONE;
  // (The window's normalisation: a packed batch's by max_seqlen_k, as flash_attn's.)
  const int64_t seqlen_k = kind == kVarlenFwd ? max_k : keys.size(1);

  PyObject* const* opt = a + kDataTensors[kind] + n_seq;
  double dropout = 1, scale = 0, softcap = 0;
  bool causal = false, deterministic = false, probs = false, torch_scratch = true;
  int64_t w[2] = {0, 0};
  std::optional<at::Tensor> slopes;
  if (!float_arg(opt[0], dropout) || dropout != 0.0 || !scale_arg(opt[1], scale) || !bool_arg(opt[2], causal) ||
      !window_arg(opt[3], w) || !float_arg(opt[4], softcap) || !optional_tensor_arg(opt[5], slopes) ||
      !bool_arg(opt[6], deterministic) || !bool_arg(opt[7], probs) || !bool_arg(opt[8], torch_scratch)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (softcap < 0) softcap = 0;  // flash_attn: only softcap > 0 turns it on
  if (!softcap_ok(softcap)) Py_RETURN_NONE;
  // (The Python function shifts the returned LSE by ALiBi's row term where flash_attn's does.)
  if (probs && slopes) Py_RETURN_NONE;
  for (int64_t& side : w)
    if (side < 0 || side >= seqlen_k) side = -1;  // unbounded
  if (causal) w[1] = -1;  // the causal mask bounds the right side already
  return wrap(run(kind, in, sq, slopes,
                  make_opts(scale, causal ? FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT : FLASHATTN_MASK_NONE,
                            FLASHATTN_PRECISION_FP32, 0, deterministic, w[0], w[1], softcap, torch_scratch),
                  max_q, max_k),
              probs ? kOutLseNone : kOut);
  END_HANDLE_TH_ERRORS
}

// set_custom_kernels(on, torch_scratch): see torch_ops.hpp.
PyObject* set_custom_kernels(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  bool on = false, torch_scratch = true;
  if (nargs != 2 || !bool_arg(args[0], on) || !bool_arg(args[1], torch_scratch)) {
    PyErr_SetString(PyExc_TypeError, "flashattn._torch_ops.set_custom_kernels(on: bool, torch_scratch: bool)");
    return nullptr;
  }
  flashattn_torch::set_custom_kernels(on, torch_scratch);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"set_custom_kernels", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_custom_kernels)),
     METH_FASTCALL, "set_custom_kernels(on, torch_scratch): C++ kernels for flashattn.torch's custom ops (or not)"},
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward)), METH_FASTCALL,
     "forward(kind, *op_inputs, torch_scratch) -> (out, lse), or None where the op must serve the call"},
    {"attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(attention)), METH_FASTCALL,
     "attention(q, k, v, softmax_scale, mask, window_size, softcap, alibi_slopes, precision, num_threads, "
     "deterministic, return_lse, is_causal, scale, enable_gqa, torch_scratch) -> attention()'s result, or None where "
     "the Python function must serve the call"},
    {"flash_attn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(flash_attn)), METH_FASTCALL,
     "flash_attn(kind, *data, [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,] dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, "
     "return_attn_probs, torch_scratch) -> flash_attn's result, or None where the Python function must serve the "
     "call"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_torch_ops",
                       "flashattn.torch's C++ eager ops (registered as torch.ops.flashattn_eager on import) and "
                       "their direct forward entry",
                       -1, kMethods};

}  // namespace

// Importing flashattn._torch_ops loads the library, which registers the ops (TORCH_LIBRARY in
// torch_ops.cpp), and gives the direct entry.
PyMODINIT_FUNC PyInit__torch_ops() { return PyModule_Create(&kModule); }
