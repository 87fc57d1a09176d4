// Host time of one library call through the C ABI, with nothing around it (no Python, no
// framework): tiny CUDA problems whose device work is a few microseconds, called back to back, so
// that wall time / calls is the host's cost of a call (validation, planning, scratch, tensor
// maps, launches). Splits it by also timing the workspace query (validation and planning only:
// it launches nothing) and a one-byte cudaMemsetAsync (the runtime's floor for one enqueue).
// Framework integration: the C++ part of a PyTorch call's host time (bench/host_overhead.py
// times the whole call).
//
// Two more rows time the driver calls a call makes per tensor: cudaPointerGetAttributes (the
// validation's device check) and cuTensorMapEncodeTiled (the sm_90a kernels' operands).
//
// usage: flashattn-bench-host [--b 1] [--h 1] [--s 128] [--d 64] [--dtype bf16|fp16|fp32]
//                             [--calls 2000] [--rounds 5] [--causal 0|1]
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void ok(int status, const char* what) {
  if (status != FLASHATTN_OK) {
    std::fprintf(stderr, "%s: %s\n", what, flashattn_last_error());
    std::exit(1);
  }
}

// Median over `rounds` of wall time per call (us) of `calls` back-to-back calls, the device
// synchronised at the end of each round (its queued work is counted: a few us per call here).
double per_call_us(const std::function<void()>& f, int calls, int rounds) {
  for (int i = 0; i < 50; ++i) f();
  check(cudaDeviceSynchronize(), "sync");
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    check(cudaDeviceSynchronize(), "sync");
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t b = 1, h = 1, s = 128, d = 64;
  int calls = 2000, rounds = 5, causal = 0;
  std::string dt = "bf16";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--b") b = std::atoll(v);
    else if (a == "--h") h = std::atoll(v);
    else if (a == "--s") s = std::atoll(v);
    else if (a == "--d") d = std::atoll(v);
    else if (a == "--dtype") dt = v;
    else if (a == "--calls") calls = std::atoi(v);
    else if (a == "--rounds") rounds = std::atoi(v);
    else if (a == "--causal") causal = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const int dtype = dt == "fp32" ? FLASHATTN_FLOAT32 : dt == "fp16" ? FLASHATTN_FLOAT16 : FLASHATTN_BFLOAT16;
  const size_t es = dtype == FLASHATTN_FLOAT32 ? 4 : 2;
  const size_t n = static_cast<size_t>(b * h * s * d);
  void* buf[8];
  for (void*& p : buf) {
    check(cudaMalloc(&p, n * es), "cudaMalloc");
    check(cudaMemset(p, 0, n * es), "cudaMemset");
  }
  float* lse = nullptr;
  check(cudaMalloc(&lse, static_cast<size_t>(b * h * s) * sizeof(float)), "cudaMalloc");
  auto t4 = [&](void* p) {
    flashattn_tensor t{};
    t.data = p; t.dtype = dtype; t.device = 0; t.ndim = 4;
    const int64_t sh[4] = {b, h, s, d}, st[4] = {h * s * d, s * d, d, 1};
    for (int i = 0; i < 4; ++i) { t.shape[i] = sh[i]; t.stride[i] = st[i]; }
    return t;
  };
  const flashattn_tensor q = t4(buf[0]), k = t4(buf[1]), v = t4(buf[2]), o = t4(buf[3]), dout = t4(buf[4]),
                         dq = t4(buf[5]), dk = t4(buf[6]), dv = t4(buf[7]);
  flashattn_tensor l{};
  l.data = lse; l.dtype = FLASHATTN_FLOAT32; l.device = 0; l.ndim = 3;
  l.shape[0] = b; l.shape[1] = h; l.shape[2] = s;
  l.stride[0] = h * s; l.stride[1] = s; l.stride[2] = 1;
  flashattn_options opt;
  flashattn_options_init(&opt);
  opt.mask = causal ? FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT : FLASHATTN_MASK_NONE;
  uint64_t need_f = 0, need_b = 0;
  flashattn_options qf = opt, qb = opt;
  qf.workspace_query = &need_f;
  qb.workspace_query = &need_b;
  ok(flashattn_forward(&q, &k, &v, &o, &l, &qf), "forward query");
  ok(flashattn_forward(&q, &k, &v, &o, &l, &opt), "forward");
  ok(flashattn_backward(&q, &k, &v, &o, &dout, &l, &dq, &dk, &dv, &qb), "backward query");
  void* ws = nullptr;
  check(cudaMalloc(&ws, std::max<uint64_t>(need_b, 256)), "cudaMalloc");
  flashattn_options wb = opt;
  wb.workspace = need_b > 0 ? ws : nullptr;
  wb.workspace_bytes = need_b;
  char* one = nullptr;
  check(cudaMalloc(&one, 16), "cudaMalloc");

  std::printf("# host time per call (us), C ABI, CUDA %s, B%lld H%lld S%lld D%lld%s; median of %d rounds of %d calls\n",
              dt.c_str(), static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(s),
              static_cast<long long>(d), causal ? " causal" : "", rounds, calls);
  std::printf("| what | us per call |\n| --- | --- |\n");
  auto row = [&](const char* what, const std::function<void()>& f) {
    std::printf("| %s | %.2f |\n", what, per_call_us(f, calls, rounds));
    std::fflush(stdout);
  };
  row("cudaMemsetAsync of 1 byte (one enqueue)", [&] { check(cudaMemsetAsync(one, 0, 1, nullptr), "memset"); });
  row("cudaPointerGetAttributes (one tensor's device check)", [&] {
    cudaPointerAttributes at{};
    check(cudaPointerGetAttributes(&at, buf[0]), "cudaPointerGetAttributes");
  });
  {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qr{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr) == cudaSuccess &&
        qr == cudaDriverEntryPointSuccess && fn != nullptr && es == 2) {
      const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
      alignas(64) CUtensorMap map;
      // q as the kernels map it: head_dim, seq, heads, batch; 128-byte box rows of 64 rows.
      cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(s), static_cast<cuuint64_t>(h),
                            static_cast<cuuint64_t>(b)};
      cuuint64_t strides[3] = {static_cast<cuuint64_t>(d) * es, static_cast<cuuint64_t>(s * d) * es,
                               static_cast<cuuint64_t>(h * s * d) * es};
      cuuint32_t box[4] = {64, 64, 1, 1}, ones[4] = {1, 1, 1, 1};
      row("cuTensorMapEncodeTiled (one operand's map)", [&] {
        if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, buf[0], dims, strides, box, ones,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
          std::fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
          std::exit(1);
        }
      });
    }
  }
  row("forward, workspace query (validation + plan)", [&] { ok(flashattn_forward(&q, &k, &v, &o, &l, &qf), "fq"); });
  row("forward", [&] { ok(flashattn_forward(&q, &k, &v, &o, &l, &opt), "f"); });
  row("backward, workspace query (validation + plan)",
      [&] { ok(flashattn_backward(&q, &k, &v, &o, &dout, &l, &dq, &dk, &dv, &qb), "bq"); });
  row("backward (library's pool)", [&] { ok(flashattn_backward(&q, &k, &v, &o, &dout, &l, &dq, &dk, &dv, &opt), "b"); });
  row("backward (caller's workspace)", [&] { ok(flashattn_backward(&q, &k, &v, &o, &dout, &l, &dq, &dk, &dv, &wb), "bw"); });
  row("forward + backward", [&] {
    ok(flashattn_forward(&q, &k, &v, &o, &l, &opt), "f");
    ok(flashattn_backward(&q, &k, &v, &o, &dout, &l, &dq, &dk, &dv, &opt), "b");
  });
  std::printf("backward scratch: %llu bytes\n", static_cast<unsigned long long>(need_b));
  for (void* p : buf) cudaFree(p);
  cudaFree(lse);
  cudaFree(ws);
  cudaFree(one);
  return 0;
}
