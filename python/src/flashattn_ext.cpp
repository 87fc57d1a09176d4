// flashattn._ext: the nanobind extension behind the `flashattn` Python package.
//
// Deliberately thin: it turns DLPack tensors (NumPy, PyTorch, CuPy, JAX, ...) into
// flashattn_tensor views, calls the C ABI with the GIL released and maps status codes to Python
// exceptions carrying the library's message. Allocation, framework detection and streams are
// decided in Python (flashattn/_api.py), where each framework's own allocator is at hand.
//
// Going through the C ABI rather than the C++ API keeps the extension bound to the one stable
// contract that every other language binding also uses.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define FLASHATTN_EXT_DLFCN 1
#endif
#include <optional>
#include <sstream>
#include <string>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"

namespace nb = nanobind;

namespace {

// DLPack device types (dlpack.h, DLDeviceType).
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;      // pinned host memory: the CPU backend may read it directly
constexpr int kDLCUDAManaged = 13;  // unified memory: addressable by the device that owns it

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

std::string py_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

std::string dtype_str(nb::dlpack::dtype d) {
  const char* base = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: return "DLPack dtype code " + std::to_string(d.code) + " with " +
                    std::to_string(d.bits) + " bits";
  }
  return base + std::to_string(d.bits);
}

// DLPack dtype -> flashattn dtype code, or -1.
int32_t dtype_code(nb::dlpack::dtype d) {
  if (d.lanes != 1) return -1;
  if (d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)) {
    if (d.bits == 32) return FLASHATTN_FLOAT32;
    if (d.bits == 16) return FLASHATTN_FLOAT16;
    if (d.bits == 64) return FLASHATTN_FLOAT64;
  }
  if (d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16)
    return FLASHATTN_BFLOAT16;
  return -1;
}

// A converted argument: the ndarray keeps the producer's memory alive while the library runs.
template <class Array>
struct Arg {
  Array array;
  flashattn_tensor view{};
};

// What a tensor argument may be, for the messages of the checks made here (before the library
// sees it): q-like tensors take any of flashattn's dtypes and 4 dimensions (lse 3); the ALiBi
// slopes only float32 with 1 or 2.
struct Kind {
  const char* dtypes = " is not supported (flashattn takes float32, float16, bfloat16, and "
                       "float64 on the CPU)";
  const char* ndims = nullptr;  // nullptr: "4", or "3" for lse (the library checks the exact ndim)
  size_t min_ndim = 0, max_ndim = 4;
  bool index = false;  // the varlen sequence arrays: int32 only
};

// The varlen call's packed operands ([total, H, D]; lse [Hq, total_q]) and its int32 arrays.
const Kind kPacked{Kind{}.dtypes, "3", 0, 4};
const Kind kPackedLse{Kind{}.dtypes, "2", 0, 4};
const Kind kIndex{", expected int32", "1", 1, 1, true};
// The KV-cache call's block_table (int32 [B, max_blocks]) and rotary tables ([S_ro, rotary_dim / 2]).
const Kind kBlockTable{", expected int32", "2", 2, 2, true};
const Kind kRotary{Kind{}.dtypes, "2", 2, 2};

template <class Array>
Arg<Array> convert(nb::handle obj, const char* name, bool is_output, const Kind& kind = {}) {
  Arg<Array> a;
  if (!nb::try_cast<Array>(obj, a.array, /*convert=*/false)) {
    InArray probe;
    if (is_output && nb::try_cast<InArray>(obj, probe, /*convert=*/false))
      throw nb::type_error((std::string(name) + ": the " + py_type_name(obj) +
                            " is read-only; outputs must be writable")
                               .c_str());
    throw nb::type_error((std::string(name) + ": expected a tensor that supports DLPack (NumPy, "
                          "PyTorch, CuPy, JAX, ...), got " + py_type_name(obj))
                             .c_str());
  }
  const Array& t = a.array;
  const nb::dlpack::dtype dt = t.dtype();
  const bool is_int32 = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) &&
                        dt.bits == 32 && dt.lanes == 1;
  const int32_t code = kind.index ? (is_int32 ? FLASHATTN_INT32 : -1) : dtype_code(dt);
  if (code < 0)
    throw nb::type_error(
        (std::string(name) + ".dtype = " + dtype_str(t.dtype()) + kind.dtypes).c_str());
  if (t.ndim() < kind.min_ndim || t.ndim() > kind.max_ndim) {
    const char* want = kind.ndims ? kind.ndims : std::strcmp(name, "lse") == 0 ? "3" : "4";
    throw nb::value_error(
        (std::string(name) + ".ndim = " + std::to_string(t.ndim()) + ", expected " + want).c_str());
  }
  int32_t device;
  switch (t.device_type()) {
    case kDLCPU:
    case kDLCUDAHost: device = FLASHATTN_CPU; break;
    case kDLCUDA:
    case kDLCUDAManaged: device = t.device_id(); break;
    default:
      throw nb::value_error((std::string(name) + " lives on DLPack device type " +
                             std::to_string(t.device_type()) +
                             "; flashattn supports CPU and CUDA memory")
                                .c_str());
  }
  a.view.data = const_cast<void*>(static_cast<const void*>(t.data()));
  a.view.dtype = code;
  a.view.device = device;
  a.view.ndim = static_cast<int32_t>(t.ndim());
  for (size_t i = 0; i < t.ndim(); ++i) {
    a.view.shape[i] = t.shape(i);
    a.view.stride[i] = t.stride(i);
  }
  return a;
}

// The ALiBi slopes, when given: float32 [Hq] or [B, Hq] (the library checks the sizes, device
// and alignment against q).
struct Slopes {
  std::optional<Arg<InArray>> arg;
  explicit Slopes(nb::handle obj) {
    if (obj.is_none()) return;
    arg = convert<InArray>(obj, "alibi_slopes", false,
                           Kind{", expected float32", "1 ([Hq]) or 2 ([B, Hq])", 1, 2});
  }
  const flashattn_tensor* view() const { return arg ? &arg->view : nullptr; }
};

// The ABI takes the softmax scale and the softcap as float32: a nonzero value that rounds to 0
// there would silently read as "default" / "none".
float to_float32(double value, const char* name, const char* zero_means) {
  const float f = static_cast<float>(value);
  if (value != 0.0 && f == 0.0f) {
    std::ostringstream os;
    os << name << " = " << value << " underflows to 0 in float32 (0 means " << zero_means << ")";
    throw nb::value_error(os.str().c_str());
  }
  return f;
}

// The caller's CUDA scratch (options.workspace, from the torch layer's caching allocator) or a
// query of its size (options.workspace_query: the call then only validates).
struct Scratch {
  uintptr_t workspace = 0;
  uint64_t bytes = 0;
  bool query = false;
  uint64_t need = 0;
};

flashattn_options make_options(double softmax_scale, int mask, int precision, int num_threads,
                               uintptr_t stream, bool deterministic, int64_t window_left,
                               int64_t window_right, double softcap, const Slopes& slopes,
                               Scratch* scratch = nullptr) {
  flashattn_options o;
  flashattn_options_init(&o);
  o.softmax_scale = to_float32(softmax_scale, "softmax_scale", "1/sqrt(head_dim)");
  o.mask = mask;
  o.precision = precision;
  o.num_threads = num_threads;
  o.stream = reinterpret_cast<void*>(stream);
  o.deterministic = deterministic ? 1 : 0;
  // (-1, -1) is no window at all; the library validates the values (>= -1).
  o.sliding_window = window_left != -1 || window_right != -1 ? 1 : 0;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = to_float32(softcap, "softcap", "no softcap");
  o.alibi_slopes = slopes.view();
  if (scratch != nullptr) {
    o.workspace = reinterpret_cast<void*>(scratch->workspace);
    o.workspace_bytes = scratch->bytes;
    o.workspace_query = scratch->query ? &scratch->need : nullptr;
  }
  return o;
}

[[noreturn]] void raise(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw nb::python_error();
}

// Status -> exception: invalid arguments are a TypeError when the message concerns a dtype (every
// dtype message of the library names a `.dtype` field: mixed dtypes, a float16 lse, ...), else a
// ValueError. Unsupported is always NotImplementedError (a RuntimeError): the call is valid and
// this build or device cannot serve it (float64 on CUDA, a CUDA dtype without kernels, ...), so
// it must not read as the caller's type error, and the library alone decides what it serves.
[[noreturn]] void raise_status(int status) {
  const std::string msg = flashattn_last_error();
  const bool about_dtype = msg.find(".dtype") != std::string::npos;
  switch (status) {
    case FLASHATTN_ERROR_INVALID_ARGUMENT:
      raise(about_dtype ? PyExc_TypeError : PyExc_ValueError, msg);
    case FLASHATTN_ERROR_UNSUPPORTED:
      raise(PyExc_NotImplementedError, msg);
    case FLASHATTN_ERROR_OUT_OF_MEMORY:
      raise(PyExc_MemoryError, msg);
    default:
      raise(PyExc_RuntimeError, std::string(flashattn_status_string(status)) + ": " + msg);
  }
}

// FlashAttention's [B, S, H, D] tensors read as the library's logical [B, H, S, D] (bshd = true):
// dims 1 and 2 swapped in the view, the same memory. (A torch transpose per tensor instead costs
// a Python call and a view object each: twelve per forward and backward.)
void as_bhsd(flashattn_tensor& v) {
  if (v.ndim != 4) return;
  std::swap(v.shape[1], v.shape[2]);
  std::swap(v.stride[1], v.stride[2]);
}

uint64_t forward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
             double softmax_scale, int mask, int precision, int num_threads, uintptr_t stream,
             bool deterministic, int64_t window_left, int64_t window_right, double softcap,
             nb::handle alibi_slopes, uintptr_t workspace,
    uint64_t workspace_bytes, bool query, bool bshd) {
  Scratch scratch{workspace, workspace_bytes, query, 0};
  auto tq = convert<InArray>(q, "q", false), tk = convert<InArray>(k, "k", false),
       tv = convert<InArray>(v, "v", false);
  auto to = convert<OutArray>(out, "out", true), tl = convert<OutArray>(lse, "lse", true);
  if (bshd)
    for (flashattn_tensor* x : {&tq.view, &tk.view, &tv.view, &to.view}) as_bhsd(*x);
  const Slopes slopes(alibi_slopes);
  const flashattn_options o = make_options(softmax_scale, mask, precision, num_threads, stream,
                                           deterministic, window_left, window_right, softcap,
                                           slopes, &scratch);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_forward(&tq.view, &tk.view, &tv.view, &to.view, &tl.view, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
  return scratch.need;
}

uint64_t backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
              nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv, double softmax_scale,
              int mask, int precision, int num_threads, uintptr_t stream, bool deterministic,
              int64_t window_left, int64_t window_right, double softcap,
              nb::handle alibi_slopes, uintptr_t workspace,
    uint64_t workspace_bytes, bool query, bool bshd) {
  Scratch scratch{workspace, workspace_bytes, query, 0};
  auto tdo = convert<InArray>(dout, "dout", false), tq = convert<InArray>(q, "q", false),
       tk = convert<InArray>(k, "k", false), tv = convert<InArray>(v, "v", false),
       to = convert<InArray>(out, "out", false), tl = convert<InArray>(lse, "lse", false);
  auto tdq = convert<OutArray>(dq, "dq", true), tdk = convert<OutArray>(dk, "dk", true),
       tdv = convert<OutArray>(dv, "dv", true);
  if (bshd)
    for (flashattn_tensor* x : {&tdo.view, &tq.view, &tk.view, &tv.view, &to.view, &tdq.view, &tdk.view, &tdv.view})
      as_bhsd(*x);
  const Slopes slopes(alibi_slopes);
  const flashattn_options o = make_options(softmax_scale, mask, precision, num_threads, stream,
                                           deterministic, window_left, window_right, softcap,
                                           slopes, &scratch);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_backward(&tq.view, &tk.view, &tv.view, &to.view, &tdo.view, &tl.view,
                                &tdq.view, &tdk.view, &tdv.view, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
  return scratch.need;
}

// The varlen arrays: cu_seqlens_q / _k and the optional seqused_k stay referenced (their ndarray
// views) while the library reads them.
struct VarlenArgs {
  Arg<InArray> cq, ck;
  std::optional<Arg<InArray>> used;
  flashattn_varlen vl{};
  VarlenArgs(nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
             int64_t max_seqlen_q, int64_t max_seqlen_k)
      : cq(convert<InArray>(cu_seqlens_q, "cu_seqlens_q", false, kIndex)),
        ck(convert<InArray>(cu_seqlens_k, "cu_seqlens_k", false, kIndex)) {
    if (!seqused_k.is_none()) used = convert<InArray>(seqused_k, "seqused_k", false, kIndex);
    vl.struct_size = sizeof(flashattn_varlen);
    vl.cu_seqlens_q = &cq.view;
    vl.cu_seqlens_k = &ck.view;
    vl.seqused_k = used ? &used->view : nullptr;
    vl.max_seqlen_q = max_seqlen_q;
    vl.max_seqlen_k = max_seqlen_k;
  }
};

uint64_t forward_varlen(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                    nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, int mask,
                    int precision, int num_threads, uintptr_t stream, bool deterministic,
                    int64_t window_left, int64_t window_right, double softcap,
                    nb::handle alibi_slopes, uintptr_t workspace,
    uint64_t workspace_bytes, bool query) {
  Scratch scratch{workspace, workspace_bytes, query, 0};
  auto tq = convert<InArray>(q, "q", false, kPacked), tk = convert<InArray>(k, "k", false, kPacked),
       tv = convert<InArray>(v, "v", false, kPacked);
  auto to = convert<OutArray>(out, "out", true, kPacked),
       tl = convert<OutArray>(lse, "lse", true, kPackedLse);
  const VarlenArgs va(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const Slopes slopes(alibi_slopes);
  const flashattn_options o = make_options(softmax_scale, mask, precision, num_threads, stream,
                                           deterministic, window_left, window_right, softcap,
                                           slopes, &scratch);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_forward_varlen(&tq.view, &tk.view, &tv.view, &to.view, &tl.view, &va.vl,
                                      &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
  return scratch.need;
}

uint64_t backward_varlen(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                     nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv,
                     nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, int mask,
                     int precision, int num_threads, uintptr_t stream, bool deterministic,
                     int64_t window_left, int64_t window_right, double softcap,
                     nb::handle alibi_slopes, uintptr_t workspace,
    uint64_t workspace_bytes, bool query) {
  Scratch scratch{workspace, workspace_bytes, query, 0};
  auto tdo = convert<InArray>(dout, "dout", false, kPacked),
       tq = convert<InArray>(q, "q", false, kPacked), tk = convert<InArray>(k, "k", false, kPacked),
       tv = convert<InArray>(v, "v", false, kPacked),
       to = convert<InArray>(out, "out", false, kPacked),
       tl = convert<InArray>(lse, "lse", false, kPackedLse);
  auto tdq = convert<OutArray>(dq, "dq", true, kPacked),
       tdk = convert<OutArray>(dk, "dk", true, kPacked),
       tdv = convert<OutArray>(dv, "dv", true, kPacked);
  const VarlenArgs va(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const Slopes slopes(alibi_slopes);
  const flashattn_options o = make_options(softmax_scale, mask, precision, num_threads, stream,
                                           deterministic, window_left, window_right, softcap,
                                           slopes, &scratch);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_backward_varlen(&tq.view, &tk.view, &tv.view, &to.view, &tdo.view,
                                       &tl.view, &tdq.view, &tdk.view, &tdv.view, &va.vl, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
  return scratch.need;
}

// An optional argument: held (its ndarray keeps the memory alive) while the library reads it.
template <class Array>
struct OptArg {
  std::optional<Arg<Array>> arg;
  OptArg(nb::handle obj, const char* name, bool is_output, const Kind& kind = {}) {
    if (!obj.is_none()) arg = convert<Array>(obj, name, is_output, kind);
  }
  const flashattn_tensor* view() const { return arg ? &arg->view : nullptr; }
};

// KV-cache attention. The caches are outputs when new keys are appended (they must be writable
// then), inputs otherwise, so that a read-only cache can still be attended.
void forward_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                     nb::handle lse, nb::handle k_new, nb::handle v_new, nb::handle cache_seqlens,
                     nb::handle cache_batch_idx, nb::handle cache_leftpad, nb::handle block_table,
                     nb::handle rotary_cos, nb::handle rotary_sin, bool rotary_interleaved,
                     double softmax_scale, int mask, int precision, int num_threads,
                     uintptr_t stream, bool deterministic, int64_t window_left,
                     int64_t window_right, double softcap, nb::handle alibi_slopes, int num_splits) {
  const bool append = !k_new.is_none();
  const nb::handle none(Py_None);
  auto tq = convert<InArray>(q, "q", false);
  const OptArg<OutArray> kc_out(append ? k_cache : none, "k_cache", true),
      vc_out(append ? v_cache : none, "v_cache", true);
  const OptArg<InArray> kc_in(append ? none : k_cache, "k_cache", false),
      vc_in(append ? none : v_cache, "v_cache", false);
  auto to = convert<OutArray>(out, "out", true), tl = convert<OutArray>(lse, "lse", true);
  const OptArg<InArray> kn(k_new, "k_new", false), vn(v_new, "v_new", false),
      sl(cache_seqlens, "cache_seqlens", false, kIndex),
      bi(cache_batch_idx, "cache_batch_idx", false, kIndex),
      lp(cache_leftpad, "cache_leftpad", false, kIndex),
      bt(block_table, "block_table", false, kBlockTable),
      cs(rotary_cos, "rotary_cos", false, kRotary), sn(rotary_sin, "rotary_sin", false, kRotary);
  const Slopes slopes(alibi_slopes);
  const flashattn_options o = make_options(softmax_scale, mask, precision, num_threads, stream,
                                           deterministic, window_left, window_right, softcap,
                                           slopes);
  flashattn_kvcache kv;
  flashattn_kvcache_init(&kv);
  kv.k_new = kn.view();
  kv.v_new = vn.view();
  kv.cache_seqlens = sl.view();
  kv.cache_batch_idx = bi.view();
  kv.cache_leftpad = lp.view();
  kv.block_table = bt.view();
  kv.rotary_cos = cs.view();
  kv.rotary_sin = sn.view();
  kv.rotary_interleaved = rotary_interleaved ? 1 : 0;
  kv.num_splits = num_splits;
  const flashattn_tensor* tkc = append ? kc_out.view() : kc_in.view();
  const flashattn_tensor* tvc = append ? vc_out.view() : vc_in.view();
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_forward_kvcache(&tq.view, tkc, tvc, &to.view, &tl.view, &kv, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
}

// ---- CPU calls on an OpenMP runtime's threads (flashattn_set_cpu_team_runner) --------------------
// PyTorch's CPU operators run on an OpenMP team whose workers spin for a while after each
// operator; a second set of threads (the library's pools) then competes with them for the cores.
// Running the library's CPU calls as parallel regions of that same runtime puts them on those very
// threads. The runtime is the one already loaded (dlopen with RTLD_NOLOAD: never a second copy);
// GOMP_parallel is GNU OpenMP's entry point, which LLVM's libomp provides too.
struct OpenMP {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
  int (*thread_num)() = nullptr;
};
OpenMP g_openmp;

struct OpenMPCall {
  flashattn_cpu_team_body body;
  void* arg;
};
void openmp_member(void* data) {
  const OpenMPCall& c = *static_cast<const OpenMPCall*>(data);
  c.body(c.arg, g_openmp.thread_num());
}
void openmp_runner(void*, int32_t threads, flashattn_cpu_team_body body, void* arg) {
  OpenMPCall c{body, arg};
  g_openmp.parallel(&openmp_member, &c, static_cast<unsigned>(threads), 0);
}

// True when the OpenMP runtime at `path` is loaded in this process and now runs the CPU calls.
bool use_openmp_runtime(const std::string& path) {
#if defined(FLASHATTN_EXT_DLFCN)
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return false;
  void* par = dlsym(h, "GOMP_parallel");
  void* num = dlsym(h, "omp_get_thread_num");
  if (par == nullptr || num == nullptr) {
    dlclose(h);
    return false;
  }
  // (The handle stays open: the runtime must outlive every call made through it.)
  g_openmp.parallel = reinterpret_cast<decltype(g_openmp.parallel)>(par);
  g_openmp.thread_num = reinterpret_cast<decltype(g_openmp.thread_num)>(num);
  return flashattn_set_cpu_team_runner(&openmp_runner, nullptr) == FLASHATTN_OK;
#else
  (void)path;
  return false;
#endif
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flashattn's C ABI over DLPack tensors (use the functions of the flashattn package)";
  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("softmax_scale"), nb::arg("mask"), nb::arg("precision"),
        nb::arg("num_threads"), nb::arg("stream"), nb::arg("deterministic") = false,
        nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("softcap") = 0.0,
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
        nb::arg("query") = false, nb::arg("bshd") = false,
        "Runs flashattn_forward on DLPack tensors in the library's logical [B, H, S, D] order "
        "(bshd: q, k, v, out given as [B, S, H, D]); out and lse are written in place. "
        "softmax_scale 0 means 1/sqrt(D); window (-1, -1) means none, softcap 0 none, "
        "alibi_slopes None none.");
  m.def("backward", &backward, nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("softmax_scale"), nb::arg("mask"), nb::arg("precision"), nb::arg("num_threads"),
        nb::arg("stream"), nb::arg("deterministic") = false, nb::arg("window_left") = -1,
        nb::arg("window_right") = -1, nb::arg("softcap") = 0.0,
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
        nb::arg("query") = false, nb::arg("bshd") = false,
        "Runs flashattn_backward on DLPack tensors (bshd: the 4-d ones given as [B, S, H, D]); "
        "dq, dk and dv are written in place. "
        "deterministic: a bitwise-reproducible backward (CUDA float16/bfloat16: no dQ atomics). "
        "The window, softcap and alibi_slopes must be the forward's.");
  m.def("forward_varlen", &forward_varlen, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("lse"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
        nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
        nb::arg("softmax_scale"), nb::arg("mask"), nb::arg("precision"), nb::arg("num_threads"),
        nb::arg("stream"), nb::arg("deterministic") = false, nb::arg("window_left") = -1,
        nb::arg("window_right") = -1, nb::arg("softcap") = 0.0,
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
        nb::arg("query") = false,
        "Runs flashattn_forward_varlen: q, out [total_q, Hq, D], k, v [total_k, Hkv, D], lse "
        "float32 [Hq, total_q]; cu_seqlens_q / _k int32 [B + 1], seqused_k None or int32 [B]. "
        "out and lse are written in place; options as forward().");
  m.def("backward_varlen", &backward_varlen, nb::arg("dout"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("seqused_k").none(),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("softmax_scale"),
        nb::arg("mask"), nb::arg("precision"), nb::arg("num_threads"), nb::arg("stream"),
        nb::arg("deterministic") = false, nb::arg("window_left") = -1,
        nb::arg("window_right") = -1, nb::arg("softcap") = 0.0,
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
        nb::arg("query") = false,
        "Runs flashattn_backward_varlen (layouts as forward_varlen); dq, dk and dv are written "
        "in place. Options and sequence arrays must be the forward's.");
  m.def("forward_kvcache", &forward_kvcache, nb::arg("q"), nb::arg("k_cache"),
        nb::arg("v_cache"), nb::arg("out"), nb::arg("lse"), nb::arg("k_new").none(),
        nb::arg("v_new").none(), nb::arg("cache_seqlens").none(),
        nb::arg("cache_batch_idx").none(), nb::arg("cache_leftpad").none(),
        nb::arg("block_table").none(), nb::arg("rotary_cos").none(),
        nb::arg("rotary_sin").none(), nb::arg("rotary_interleaved"), nb::arg("softmax_scale"),
        nb::arg("mask"), nb::arg("precision"), nb::arg("num_threads"), nb::arg("stream"),
        nb::arg("deterministic") = false, nb::arg("window_left") = -1,
        nb::arg("window_right") = -1, nb::arg("softcap") = 0.0,
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("num_splits") = 0,
        "Runs flashattn_forward_kvcache in FlashAttention's [B, S, H, D] order: q, out "
        "[B, Sq, Hq, D], caches [B_cache, S_cache, Hkv, D] (paged: [num_blocks, block_size, Hkv, "
        "D]), k_new / v_new [B, S_new, Hkv, D], lse float32 [B, Hq, Sq]; int32 index arrays. out "
        "and lse are written in place, and k_new / v_new appended into the caches.");
  m.def("version", [] { return std::string(flashattn_version()); },
        "Version of the libflashattn that is loaded.");
  m.def("cuda_available", [] { return flashattn_cuda_available() != 0; },
        "True when libflashattn was built with CUDA and a CUDA device is usable.");
  m.def("cuda_take_check_failures",
        [](int32_t device) {
          int64_t n = 0;
          const int status = flashattn_cuda_take_check_failures(device, &n);
          if (status != FLASHATTN_OK) raise_status(status);
          return n;
        },
        nb::arg("device") = 0,
        "Waits for the device and returns (and resets) how many graph replays of packed or "
        "KV-cache calls found index arrays that break a rule (and wrote nothing).");
  m.def("build_info", [] { return flashattn::build_info(); },
        "Backends, CPU features and kernels of the loaded libflashattn (as `flashattn info`).");
  m.def("use_openmp_runtime", &use_openmp_runtime, nb::arg("path"),
        "Runs the CPU calls as parallel regions of the OpenMP runtime loaded from `path` (already "
        "loaded in this process: e.g. PyTorch's), on its threads; False when it is not loaded or "
        "not an OpenMP runtime.");
  m.def("use_own_threads", [] { flashattn_set_cpu_team_runner(nullptr, nullptr); },
        "Back to the library's own thread pools for CPU calls.");
  m.attr("MASK_NONE") = FLASHATTN_MASK_NONE;
  m.attr("MASK_CAUSAL_TOP_LEFT") = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
  m.attr("MASK_CAUSAL_BOTTOM_RIGHT") = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  m.attr("PRECISION_FP32") = FLASHATTN_PRECISION_FP32;
  m.attr("PRECISION_TF32") = FLASHATTN_PRECISION_TF32;
}
