// FLASHATTN_HD: functions compiled for both host and device (inlined on the device), for headers
// that the CPU backend, the reference and host tests share with the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define FLASHATTN_HD __host__ __device__ __forceinline__
#else
#define FLASHATTN_HD inline
#endif
