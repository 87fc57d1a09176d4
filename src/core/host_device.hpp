// FLASHATTN_HD: functions compiled for both host and device (inlined on the device), for headers
// that the CPU backend, the reference and host tests share with the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define FLASHATTN_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// always_inline: no out-of-line copy is left in any translation unit, at any optimisation level.
// The CPU backend compiles these helpers into its AVX2 / AVX-512 units too, and an out-of-line
// copy there would be a COMDAT the linker may hand to a caller on a baseline CPU.
#define FLASHATTN_HD inline __attribute__((always_inline))
#else
#define FLASHATTN_HD inline
#endif
