// Shared-memory matrix descriptors of the warpgroup tensor-core instructions (wgmma), 128-byte
// swizzle, as host/device functions so that a host test (tests/cuda/test_smem_desc.cpp) checks
// the arithmetic the kernels rely on without a GPU.
//
// Layout of the 64-bit descriptor: start address >> 4 in bits [0, 14), leading-dimension byte
// offset >> 4 in [16, 30), stride-dimension byte offset >> 4 in [32, 46), base offset 0 (the
// swizzle atoms are 1024-byte aligned), swizzle mode 128 B in bits [62, 64).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace flashattn::cuda::dev {

//  - K-major operand (rows of the tile = M or N, columns = K): LBO unused (16), SBO = 1024, the
//    distance between 8-row groups; a k-step inside a 128-byte block moves the start by 32 B.
//  - MN-major operand (rows of the tile = K, columns = N): LBO = distance between column
//    blocks, SBO = 1024 between 8-row (k) groups; a k16 step moves the start by 16 rows.
FLASHATTN_HD constexpr uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The descriptor of the same operand `bytes` further on (a multiple of 16): one integer add on
// the start-address field. Why: a chain of wgmmas reads the k-steps of one tile at compile-time
// offsets from one start; building each descriptor from its address costs ~7 instructions per
// wgmma (masks, shifts, ORs and the moves to uniform registers), the add one. Exact as long as
// the advanced address stays below 2^18 (the field's 14 bits hold addresses >> 4): shared memory
// ends at 228 KiB, so every address inside it does, and no carry reaches the LBO field.
FLASHATTN_HD constexpr uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

}  // namespace flashattn::cuda::dev
