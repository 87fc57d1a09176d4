// The CPU kernels built for one instruction set (compiler flags in src/cpu/CMakeLists.txt).
#define FLASHATTN_CPU_ISA avx512
#define FLASHATTN_CPU_VEC_BYTES 64
#include "cpu/kernels_impl.hpp"
