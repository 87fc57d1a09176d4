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

template <class Array>
Arg<Array> convert(nb::handle obj, const char* name, bool is_output) {
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
  const int32_t code = dtype_code(t.dtype());
  if (code < 0)
    throw nb::type_error((std::string(name) + ".dtype = " + dtype_str(t.dtype()) +
                          " is not supported (flashattn takes float32, float16, bfloat16, and "
                          "float64 on the CPU)").c_str());
  if (t.ndim() > 4)
    throw nb::value_error((std::string(name) + ".ndim = " + std::to_string(t.ndim()) +
                           ", expected " + (std::strcmp(name, "lse") == 0 ? "3" : "4"))
                              .c_str());
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

flashattn_options make_options(double softmax_scale, int mask, int precision, int num_threads,
                               uintptr_t stream, bool deterministic) {
  flashattn_options o;
  flashattn_options_init(&o);
  o.softmax_scale = static_cast<float>(softmax_scale);
  if (softmax_scale != 0.0 && o.softmax_scale == 0.0f)
    throw nb::value_error(("softmax_scale = " + std::to_string(softmax_scale) +
                           " underflows to 0 in float32").c_str());
  o.mask = mask;
  o.precision = precision;
  o.num_threads = num_threads;
  o.stream = reinterpret_cast<void*>(stream);
  o.deterministic = deterministic ? 1 : 0;
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

void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
             double softmax_scale, int mask, int precision, int num_threads, uintptr_t stream,
             bool deterministic) {
  auto tq = convert<InArray>(q, "q", false), tk = convert<InArray>(k, "k", false),
       tv = convert<InArray>(v, "v", false);
  auto to = convert<OutArray>(out, "out", true), tl = convert<OutArray>(lse, "lse", true);
  const flashattn_options o =
      make_options(softmax_scale, mask, precision, num_threads, stream, deterministic);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_forward(&tq.view, &tk.view, &tv.view, &to.view, &tl.view, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
}

void backward(nb::handle dout, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
              nb::handle lse, nb::handle dq, nb::handle dk, nb::handle dv, double softmax_scale,
              int mask, int precision, int num_threads, uintptr_t stream, bool deterministic) {
  auto tdo = convert<InArray>(dout, "dout", false), tq = convert<InArray>(q, "q", false),
       tk = convert<InArray>(k, "k", false), tv = convert<InArray>(v, "v", false),
       to = convert<InArray>(out, "out", false), tl = convert<InArray>(lse, "lse", false);
  auto tdq = convert<OutArray>(dq, "dq", true), tdk = convert<OutArray>(dk, "dk", true),
       tdv = convert<OutArray>(dv, "dv", true);
  const flashattn_options o =
      make_options(softmax_scale, mask, precision, num_threads, stream, deterministic);
  int status;
  {
    nb::gil_scoped_release nogil;
    status = flashattn_backward(&tq.view, &tk.view, &tv.view, &to.view, &tdo.view, &tl.view,
                                &tdq.view, &tdk.view, &tdv.view, &o);
  }
  if (status != FLASHATTN_OK) raise_status(status);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flashattn's C ABI over DLPack tensors (use the functions of the flashattn package)";
  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("softmax_scale"), nb::arg("mask"), nb::arg("precision"),
        nb::arg("num_threads"), nb::arg("stream"), nb::arg("deterministic") = false,
        "Runs flashattn_forward on DLPack tensors in the library's logical [B, H, S, D] order; "
        "out and lse are written in place. softmax_scale 0 means 1/sqrt(D).");
  m.def("backward", &backward, nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("softmax_scale"), nb::arg("mask"), nb::arg("precision"), nb::arg("num_threads"),
        nb::arg("stream"), nb::arg("deterministic") = false,
        "Runs flashattn_backward on DLPack tensors; dq, dk and dv are written in place. "
        "deterministic: a bitwise-reproducible backward (CUDA float16/bfloat16: no dQ atomics).");
  m.def("version", [] { return std::string(flashattn_version()); },
        "Version of the libflashattn that is loaded.");
  m.def("cuda_available", [] { return flashattn_cuda_available() != 0; },
        "True when libflashattn was built with CUDA and a CUDA device is usable.");
  m.def("build_info", [] { return flashattn::build_info(); },
        "Backends, CPU features and kernels of the loaded libflashattn (as `flashattn info`).");
  m.attr("MASK_NONE") = FLASHATTN_MASK_NONE;
  m.attr("MASK_CAUSAL_TOP_LEFT") = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
  m.attr("MASK_CAUSAL_BOTTOM_RIGHT") = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  m.attr("PRECISION_FP32") = FLASHATTN_PRECISION_FP32;
  m.attr("PRECISION_TF32") = FLASHATTN_PRECISION_TF32;
}
