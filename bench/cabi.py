"""ctypes bindings of flashattn's C ABI (include/flashattn/flashattn.h) for the benchmark and
profiling scripts that call the library on torch tensors' memory without the Python package:
flashattn_tensor, flashattn_options (with struct_size versioning) and the forward/backward calls.
Tensors are torch tensors (CPU or CUDA); options carry torch's current CUDA stream when asked."""
import ctypes


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


class Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("softmax_scale", ctypes.c_float),
                ("mask", ctypes.c_int32), ("stream", ctypes.c_void_p),
                ("num_threads", ctypes.c_int32), ("precision", ctypes.c_int32),
                ("deterministic", ctypes.c_int32)]


# FLASHATTN_FLOAT32 .. FLASHATTN_FLOAT64, keyed by torch dtype name
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
MASK_NONE, MASK_CAUSAL_TOP_LEFT, MASK_CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def view(t):
    """A flashattn_tensor over a torch tensor's memory (device -1 for CPU)."""
    v = Tensor()
    v.data = t.data_ptr()
    v.dtype = DTYPE_CODES[str(t.dtype).replace("torch.", "")]
    v.device = (t.device.index or 0) if t.is_cuda else -1
    v.ndim = t.dim()
    for i in range(t.dim()):
        v.shape[i] = t.shape[i]
        v.stride[i] = t.stride(i)
    return v


class Library:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.flashattn_last_error.restype = ctypes.c_char_p
        p = ctypes.POINTER(Tensor)
        self.lib.flashattn_forward.argtypes = [p] * 5 + [ctypes.POINTER(Options)]
        self.lib.flashattn_backward.argtypes = [p] * 9 + [ctypes.POINTER(Options)]

    @staticmethod
    def options(causal=False, precision=0, deterministic=0, mask=None, cuda=True):
        """precision: 0 fp32, 1 tf32. mask overrides causal (MASK_*). cuda: pass torch's current
        stream (else the default stream / CPU)."""
        o = Options()
        o.struct_size = ctypes.sizeof(Options)
        o.mask = mask if mask is not None else (MASK_CAUSAL_TOP_LEFT if causal else MASK_NONE)
        if cuda:
            import torch
            o.stream = torch.cuda.current_stream().cuda_stream
        o.precision = precision
        o.deterministic = deterministic
        return o

    def check(self, rc):
        if rc != 0:
            raise RuntimeError(self.lib.flashattn_last_error().decode())

    def forward(self, q, k, v, out, lse, opts):
        vs = [view(t) for t in (q, k, v, out, lse)]
        self.check(self.lib.flashattn_forward(*[ctypes.byref(x) for x in vs], ctypes.byref(opts)))

    def backward(self, q, k, v, out, dout, lse, dq, dk, dv, opts):
        vs = [view(t) for t in (q, k, v, out, dout, lse, dq, dk, dv)]
        self.check(self.lib.flashattn_backward(*[ctypes.byref(x) for x in vs], ctypes.byref(opts)))
