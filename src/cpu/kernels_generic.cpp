// The CPU kernels built for one instruction set (compiler flags in src/cpu/CMakeLists.txt).
#define FLASHATTN_CPU_ISA generic
#define FLASHATTN_CPU_VEC_BYTES 16
#include "cpu/kernels_impl.hpp"
