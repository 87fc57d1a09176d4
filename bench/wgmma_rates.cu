// flashattn-bench-wgmma: the rate of each warpgroup product shape the 16-bit sm_90a backward
// issues, on this GPU, beside the widest one (m64n256k16 chains) - the ceilings against which the
// dK/dV kernel's time is read (docs/perf-log/cuda-16bit.md). One CTA per multiprocessor with two
// warpgroups, as the kernel's consumers; each warpgroup runs `iters` products of its shape on
// operands that stay in shared memory (their values do not matter to the tensor cores' speed).
// Two issue patterns: "wait" waits for each product before the next is issued (the kernel's
// pattern where a product's result is needed next), "pipe" keeps two in flight.
//
// usage: flashattn-bench-wgmma [iters (default 4096)]
// Prints TFLOP/s per shape and pattern (median of 5 timed launches, bf16 operands).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm90/wgmma.cuh"

namespace {

using flashattn::cuda::Half16;
namespace dev = flashattn::cuda::dev;

constexpr Half16 H = Half16::BF16;
using TK = dev::TileSw128<128, 128>;   // K or V of a 128-key block, D = 128
using TQ = dev::TileSw128<64, 128>;    // a 64-query tile of Q or dO
using TS = dev::TileSw128<128, 64>;    // dS^T: 128 keys x 64 queries
using TW = dev::TileSw128<256, 128>;   // a 256-row operand (the widest product's B)
constexpr int kSmem = TK::kBytes + TQ::kBytes + TS::kBytes + TW::kBytes + 1024;

// The shapes (per warpgroup, D = 128), as the backward names them.
enum Shape : int {
  kSdP = 0,    // S^T = K Q^T, dP^T = V dO^T: SS, N = 64, K = 128 (both K-major)
  kDq = 1,     // dQ = dS K: SS, N = 64, K = 128 (both MN-major)
  kDkv = 2,    // dV += P^T dO, dK += dS^T Q: RS (A in registers), N = 128, K = 64
  kSS128 = 3,  // SS, N = 128, K = 128 (what a 128-query tile's S^T would issue)
  kSS256 = 4,  // SS, N = 256, K = 128: the widest product
};
constexpr int kN[] = {64, 64, 128, 128, 256};
constexpr int kK[] = {128, 128, 64, 128, 128};
const char* const kName[] = {"S^T / dP^T  SS n64  k128", "dQ          SS n64  k128 (MN-major)",
                             "dV / dK     RS n128 k64", "SS n128 k128", "SS n256 k128 (widest)"};

template <int SHAPE, bool PIPE>
__global__ void __launch_bounds__(256, 1) rate_kernel(int iters, float* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ float4 smem4[];
  unsigned char* base = dev::smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  for (int i = threadIdx.x; i < (kSmem - 1024) / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(base)[i] = 0x3c003c00u;
  dev::fence_proxy_async();
  __syncthreads();
  const uint32_t sk = dev::smem_addr(base), sq = sk + TK::kBytes, ss = sq + TQ::kBytes, sw = ss + TS::kBytes;
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  constexpr int NT = kN[SHAPE] / 8;
  float d[NT][4];
  for (int j = 0; j < NT; ++j)
    for (int e = 0; e < 4; ++e) d[j][e] = 0.0f;
  uint32_t pa[4][4];
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 4; ++e) pa[j][e] = 0x3c003c00u ^ static_cast<uint32_t>(iters & 1);
  for (int i = 0; i < iters; ++i) {
    dev::fence_regs(d);
    dev::wgmma_fence();
    if constexpr (SHAPE == kSdP) dev::wg_gemm_nt<H, 128, TK, TQ>(d, sk, 64 * wg, sq, 0, true);
    if constexpr (SHAPE == kDq) dev::wg_gemm_tt<H, 8, TS, TK>(d, ss, 0, sk, 64 * wg, true);
    if constexpr (SHAPE == kDkv) dev::wg_gemm_rn<H, 4, TQ>(d, pa, sq, 0, 0);
    if constexpr (SHAPE == kSS128) dev::wg_gemm_nt<H, 128, TK, TK>(d, sk, 64 * wg, sk, 0, true);
    if constexpr (SHAPE == kSS256) dev::wg_gemm_nt<H, 128, TK, TW>(d, sk, 64 * wg, sw, 0, true);
    dev::wgmma_commit();
    if constexpr (PIPE) dev::wgmma_wait<1>();
    else dev::wgmma_wait<0>();
  }
  dev::wgmma_wait<0>();
  dev::fence_regs(d);
  float acc = 0.0f;
  for (int j = 0; j < NT; ++j)
    for (int e = 0; e < 4; ++e) acc += d[j][e];
  if (acc == 12345.0f) sink[threadIdx.x] = acc;  // (never true; keeps the products)
#endif
}

#define CHECK(x)                                                                                    \
  do {                                                                                              \
    cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                 \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

template <int SHAPE, bool PIPE>
double rate(int sms, int iters, float* sink) {
  auto k = rate_kernel<SHAPE, PIPE>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  k<<<sms, 256, kSmem>>>(iters, sink);  // warm-up
  CHECK(cudaGetLastError());
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(a));
    k<<<sms, 256, kSmem>>>(iters, sink);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  const double flop = 2.0 * 64 * kN[SHAPE] * kK[SHAPE] * 2 /* warpgroups */ * static_cast<double>(sms) * iters;
  return flop / t[t.size() / 2] * 1e-12;
}

template <int SHAPE>
void row(int sms, int iters, float* sink) {
  std::printf("| %-36s | %7.1f | %7.1f |\n", kName[SHAPE], rate<SHAPE, false>(sms, iters, sink),
              rate<SHAPE, true>(sms, iters, sink));
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 4096;
  int devc = 0;
  if (cudaGetDeviceCount(&devc) != cudaSuccess || devc == 0) {
    std::printf("flashattn-bench-wgmma: no CUDA device - nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("flashattn-bench-wgmma: %s is compute capability %d.%d; wgmma needs 9.0 - nothing to measure\n",
                prop.name, prop.major, prop.minor);
    return 0;
  }
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, 256 * sizeof(float)));
  std::printf("# warpgroup product rates, bf16, %s (%d SMs), %d products per warpgroup, 2 warpgroups per SM\n\n",
              prop.name, prop.multiProcessorCount, iters);
  std::printf("| shape (per warpgroup, D = 128) | wait TFLOP/s | pipe TFLOP/s |\n|---|---|---|\n");
  const int sms = prop.multiProcessorCount;
  row<kSdP>(sms, iters, sink);
  row<kDq>(sms, iters, sink);
  row<kDkv>(sms, iters, sink);
  row<kSS128>(sms, iters, sink);
  row<kSS256>(sms, iters, sink);
  CHECK(cudaFree(sink));
  return 0;
}
