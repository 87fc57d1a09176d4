// The CPU backward's two designs give the same bits (cpu/kernels_impl.hpp): the split passes (dQ
// over query blocks, dK/dV over key blocks) and the fused pass over (sequence, kv head) pairs, which
// computes S and dP once per tile and takes dQ from the same dS. The driver picks one by a cost
// model that depends on the thread count; results must not (test_determinism.cpp checks thread
// counts whichever design each picks). Here FLASHATTN_CPU_BWD forces each design through the
// public API on a grid of masks, windows, score transforms, dtypes, layouts, GQA / MQA and odd
// lengths, and on packed batches; every output element must be written (they are poisoned with
// NaN first) and equal bit for bit. Accuracy against the float64 reference: every CPU grid (the
// designs the thread counts pick there) and test_cpu_mask_band.cpp (both designs, every band).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

using testing::AlibiKind;

struct Grads {
  std::vector<unsigned char> dq, dk, dv;
};

// The backward of p (forward already run) under one design and thread count, outputs poisoned
// first; fails the test if an element kept the poison.
Grads backward_with(Problem& p, const char* design, int32_t threads) {
  const DesignEnv env(design);
  // (Only the gradients: the backward reads out and lse.) All-ones bytes are NaN in every dtype.
  for (testing::HostTensor* t : {&p.dq, &p.dk, &p.dv}) std::fill(t->bytes.begin(), t->bytes.end(), 0xff);
  run_backward(p, options_for(p, threads));
  for (const testing::HostTensor* t : {&p.dq, &p.dk, &p.dv})
    for (double x : p.to_double(*t))
      if (std::isnan(x)) {
        ADD_FAILURE() << design << ": an output element kept its NaN poison";
        return {};
      }
  return Grads{p.dq.bytes, p.dk.bytes, p.dv.bytes};
}

struct Shape5 {
  int64_t batch, hq, hkv, sq, skv, d;
};

TEST(CpuBackwardDesigns, FusedEqualsSplitBitwise) {
  const Shape5 shapes[] = {
      {1, 1, 1, 1, 1, 1},      {2, 4, 4, 17, 17, 64},   {1, 8, 2, 97, 300, 40},  {3, 6, 1, 300, 97, 128},
      {1, 2, 1, 17, 1030, 80}, {2, 2, 2, 130, 257, 17}, {1, 4, 2, 300, 300, 256}, {2, 3, 3, 1, 300, 96},
  };
  const Mask masks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight};
  const int64_t windows[][2] = {{-1, -1}, {7, 0}, {64, 64}};
  struct Transform {
    float softcap;
    AlibiKind alibi;
  };
  const Transform transforms[] = {
      {0.0f, AlibiKind::None}, {30.0f, AlibiKind::None}, {0.0f, AlibiKind::Heads}, {5.0f, AlibiKind::BatchHeads}};
  const DType dtypes[] = {DType::Float32, DType::BFloat16, DType::Float16, DType::Float64};
  int n = 0;
  for (const Mask m : masks)
    for (const auto& w : windows)
      for (const Transform& t : transforms) {
        const Shape5& s = shapes[n % 8];
        const DType dt = dtypes[(n / 2) % 4];
        const testing::Layout layout = n % 3 == 0 ? testing::Layout::BSHD : testing::Layout::BHSD;
        ProblemConfig c = make_config(s.batch, s.hq, s.hkv, s.sq, s.skv, s.d, m, dt, layout, 0.0f,
                                      /*seed=*/100 + static_cast<uint64_t>(n));
        c.window_left = w[0];
        c.window_right = w[1];
        c.softcap = t.softcap;
        c.alibi = t.alibi;
        ++n;
        SCOPED_TRACE(c.describe());
        Problem p(c);
        run_forward(p, options_for(p, 1));
        const Grads split = backward_with(p, "split", 2);
        const Grads fused = backward_with(p, "fused", 1);
        EXPECT_TRUE(fused.dq == split.dq) << "dq differs";
        EXPECT_TRUE(fused.dk == split.dk) << "dk differs";
        EXPECT_TRUE(fused.dv == split.dv) << "dv differs";
      }
}

}  // namespace
}  // namespace flashattn::test
