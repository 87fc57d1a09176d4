// The wgmma shared-memory descriptor arithmetic of the sm_90a kernels (src/cuda/sm90/smem_desc.hpp),
// checked on the host: the kernels build one descriptor per chain of wgmmas and advance it by an
// integer add per k-step (desc_advance), which must equal the descriptor built at the advanced
// address for every start and offset the kernels can use. Runs in CI (no device needed).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/sm90/smem_desc.hpp"

namespace {

using flashattn::cuda::dev::desc_advance;
using flashattn::cuda::dev::desc_sw128;

// The largest dynamic shared memory of a Hopper CTA (227 KiB) plus the static part's reserve.
constexpr uint32_t kSmemBytes = 228 * 1024;

TEST(SmemDesc, FieldsAreWhereTheHardwareReadsThem) {
  const uint64_t d = desc_sw128(0x12340, 16, 1024);
  EXPECT_EQ(d & 0x3FFF, 0x12340u >> 4);
  EXPECT_EQ((d >> 16) & 0x3FFF, 1u);    // LBO 16 B
  EXPECT_EQ((d >> 32) & 0x3FFF, 64u);   // SBO 1024 B
  EXPECT_EQ(d >> 62, 1u);               // 128-byte swizzle
  EXPECT_EQ((d >> 14) & 0x3, 0u);       // nothing between the fields
  EXPECT_EQ((d >> 49) & 0x7, 0u);       // base offset 0
}

// Every offset a kernel adds inside a chain: k-steps of 32 B within a 128-byte block, blocks of
// kBlockBytes (rows * 128 for the tile heights in use) and the MN-major k16 step of 16 rows. (That
// a chain stays inside its tile, and so inside shared memory, wgmma.cuh asserts at compile time.)
std::vector<uint32_t> chain_offsets() {
  std::vector<uint32_t> offs;
  for (uint32_t rows : {8u, 16u, 32u, 64u, 128u, 256u})
    for (uint32_t kk = 0; kk < 32; ++kk) offs.push_back((kk >> 2) * rows * 128 + (kk & 3) * 32);
  for (uint32_t kk = 0; kk < 16; ++kk) offs.push_back(16 * kk * 128);
  return offs;
}

TEST(SmemDesc, AdvanceEqualsTheDescriptorAtTheAdvancedAddress) {
  const std::vector<uint32_t> offs = chain_offsets();
  int64_t checked = 0;
  for (uint32_t lbo : {16u, 1024u, 4096u, 8192u})
    for (uint32_t a = 0; a < kSmemBytes; a += 16)
      for (uint32_t off : offs) {
        if (a + off >= kSmemBytes) continue;
        const uint64_t want = desc_sw128(a + off, lbo, 1024);
        const uint64_t got = desc_advance(desc_sw128(a, lbo, 1024), off);
        if (got != want) {
          ADD_FAILURE() << "start " << a << " + " << off << " (lbo " << lbo << "): advanced 0x" << std::hex << got
                        << ", built 0x" << want;
          return;
        }
        ++checked;
      }
  EXPECT_GT(checked, 1000000);
}

TEST(SmemDesc, AdvanceMovesOnlyTheAddressField) {
  // The smallest k-step (32 B) at the top of shared memory: the address field holds the new start,
  // the other fields are those of the base descriptor.
  const uint32_t a = kSmemBytes - 1024;
  const uint64_t d = desc_sw128(a, 1024, 1024), adv = desc_advance(d, 32);
  EXPECT_EQ(adv & 0x3FFF, (a + 32) >> 4);
  EXPECT_EQ(adv >> 14, d >> 14);
}

}  // namespace
