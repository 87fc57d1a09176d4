// The CUDA backend's kernel selection (src/cuda/select.cpp) without a GPU: which kernel family,
// design and variant each (dtype, head dim, mask, lengths, precision, determinism, compute
// capability, override variable) gets, and the reasons given for what is unsupported. The rules
// come from measurements (docs/ALGORITHM.md states each one's reason; the runs are in
// docs/perf-log/); these tests pin them so that a change is deliberate.
// Runs everywhere the CUDA backend is built, CI included (no device needed).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda/select.hpp"

namespace flashattn::cuda {
namespace {

// Sets an environment variable for the scope, unsets it after.
class EnvScope {
 public:
  EnvScope(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~EnvScope() { unsetenv(name_); }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  const char* name_;
};

Shape shape(int64_t s, int64_t d, int64_t skv = -1) { return Shape{2, 8, 8, s, skv < 0 ? s : skv, d}; }
Numerics num(DType t, Mask m = Mask::None, Precision p = Precision::Fp32, bool det = false) {
  return Numerics{t, 0.125f, m, p, det};
}

TEST(CudaSelect, Hopper16BitUsesTheSm90KernelsAndTheAtomicBackward) {
  for (int64_t d : {64, 128, 256}) {
    const KernelChoice c = select_kernel(shape(4096, d), num(DType::BFloat16), 9, 0);
    ASSERT_TRUE(c.ok) << c.why;
    EXPECT_TRUE(c.half16);
    EXPECT_EQ(c.dp, d);
    EXPECT_TRUE(c.sm90_fwd) << "D = " << d;
    EXPECT_TRUE(c.sm90_bwd) << "D = " << d;
    EXPECT_TRUE(c.atomic_bwd) << "D = " << d;
    EXPECT_EQ(c.sm90_variant, 0) << "D = " << d;
  }
  // Head dims padded to 96 have no sm_90a kernels: mma.sync forward, split backward.
  const KernelChoice c96 = select_kernel(shape(4096, 80), num(DType::Float16), 9, 0);
  ASSERT_TRUE(c96.ok);
  EXPECT_EQ(c96.dp, 96);
  EXPECT_FALSE(c96.sm90_fwd);
  EXPECT_FALSE(c96.sm90_bwd);
  EXPECT_FALSE(c96.atomic_bwd);
}

TEST(CudaSelect, TwoCtaBackwardOnlyForShortCausalAtD64) {
  EXPECT_EQ(select_kernel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 1);
  EXPECT_EQ(select_kernel(shape(1024, 64), num(DType::BFloat16, Mask::CausalBottomRight), 9, 0).sm90_variant, 1);
  EXPECT_EQ(select_kernel(shape(2048, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  EXPECT_EQ(select_kernel(shape(512, 64, 2048), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  EXPECT_EQ(select_kernel(shape(2048, 64, 512), num(DType::BFloat16, Mask::CausalBottomRight), 9, 0).sm90_variant, 0);
  EXPECT_EQ(select_kernel(shape(512, 64), num(DType::BFloat16), 9, 0).sm90_variant, 0);
  EXPECT_EQ(select_kernel(shape(512, 128), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  {
    EnvScope e("FLASHATTN_CUDA_SM90_VARIANT", "1");
    EXPECT_EQ(select_kernel(shape(8192, 64), num(DType::BFloat16), 9, 0).sm90_variant, 1);
    EXPECT_EQ(select_kernel(shape(8192, 128), num(DType::BFloat16), 9, 0).sm90_variant, 0);  // none at D = 128
  }
  {
    EnvScope e("FLASHATTN_CUDA_SM90_VARIANT", "0");
    EXPECT_EQ(select_kernel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  }
}

TEST(CudaSelect, DeterministicMeansTheSplitBackward) {
  for (int cc : {8, 9}) {
    const KernelChoice c = select_kernel(shape(4096, 64), num(DType::BFloat16, Mask::None, Precision::Fp32, true), cc, 0);
    ASSERT_TRUE(c.ok);
    EXPECT_FALSE(c.atomic_bwd) << "sm_" << cc << "0";
    EXPECT_FALSE(c.sm90_bwd) << "sm_" << cc << "0";
  }
  // ... whatever FLASHATTN_CUDA_BWD says.
  EnvScope e("FLASHATTN_CUDA_BWD", "atomic");
  EXPECT_FALSE(select_kernel(shape(4096, 128), num(DType::BFloat16, Mask::None, Precision::Fp32, true), 9, 0).atomic_bwd);
  EXPECT_TRUE(select_kernel(shape(4096, 128), num(DType::BFloat16), 8, 0).atomic_bwd);
}

TEST(CudaSelect, OnlyComputeCapability90GetsTheSm90aKernels) {
  for (auto [major, minor] : {std::pair{8, 0}, std::pair{8, 9}, std::pair{9, 1}, std::pair{10, 0}, std::pair{12, 0}}) {
    const KernelChoice c = select_kernel(shape(4096, 128), num(DType::BFloat16), major, minor);
    ASSERT_TRUE(c.ok);
    EXPECT_FALSE(c.sm90_fwd) << major << "." << minor;
    EXPECT_FALSE(c.sm90_bwd) << major << "." << minor;
    EXPECT_FALSE(c.atomic_bwd) << major << "." << minor << ": D = 128 defaults to split off sm_90";
  }
  EnvScope e("FLASHATTN_CUDA_ARCH", "sm80");
  const KernelChoice c = select_kernel(shape(4096, 128), num(DType::BFloat16), 9, 0);
  EXPECT_FALSE(c.sm90_fwd);
  EXPECT_FALSE(c.sm90_bwd);
}

TEST(CudaSelect, Float32ArithmeticAndTheTf32HopperKernels) {
  // precision fp32 -> 3xTF32 everywhere from sm_80; tf32 -> the wgmma forward at D <= 128 on 9.0
  // and the wgmma backward (both passes) at padded D = 64 and 128; fp32 at padded D = 128: the
  // 3xTF32 wgmma forward and backward.
  EXPECT_EQ(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).math, Math::Tf32x3);
  EXPECT_TRUE(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_fwd);
  EXPECT_TRUE(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_bwd);
  for (int64_t d : {1, 64, 100, 128}) {
    const KernelChoice c = select_kernel(shape(4096, d), num(DType::Float32, Mask::None, Precision::Tf32), 9, 0);
    ASSERT_TRUE(c.ok);
    EXPECT_EQ(c.math, Math::Tf32);
    EXPECT_TRUE(c.sm90_fwd) << "D = " << d;
    EXPECT_TRUE(c.sm90_bwd) << "D = " << d;
    EXPECT_TRUE(c.tf32_dkv_wgmma) << "D = " << d;
  }
  for (Mask m : {Mask::None, Mask::CausalTopLeft})
    for (int64_t s : {1, 1024, 16384})
      EXPECT_TRUE(select_kernel(shape(s, 64), num(DType::Float32, m, Precision::Tf32), 9, 0).tf32_dkv_wgmma)
          << "S = " << s;
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  EXPECT_FALSE(select_kernel(shape(4096, 256), tf32, 9, 0).sm90_fwd);
  EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 8, 0).sm90_fwd);
  EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 8, 0).sm90_bwd);
  {
    EnvScope e("FLASHATTN_CUDA_ARCH", "sm80");
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).sm90_fwd);
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
  }
  {
    EnvScope e("FLASHATTN_CUDA_MATH", "3xtf32");  // the override wins over the precision option
    const KernelChoice c = select_kernel(shape(4096, 128), tf32, 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_fwd);  // the 3xTF32 wgmma forward
    EXPECT_TRUE(c.sm90_bwd && c.f32_pair);  // and backward
    EXPECT_TRUE(select_kernel(shape(4096, 64), tf32, 9, 0).sm90_fwd);  // (at padded D = 64 as well)
    EXPECT_TRUE(select_kernel(shape(4096, 64), tf32, 9, 0).f32_pair);  // the 3xTF32 wgmma backward
  }
  {
    EnvScope e("FLASHATTN_CUDA_MATH", "tf32");  // and the other way round: tf32's kernels
    const KernelChoice c = select_kernel(shape(4096, 64), num(DType::Float32), 9, 0);
    EXPECT_TRUE(c.sm90_fwd);
    EXPECT_TRUE(c.sm90_bwd);
  }
  {
    EnvScope e("FLASHATTN_CUDA_TF32_BWD", "wgmma-dq");
    EXPECT_TRUE(select_kernel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).tf32_dkv_wgmma);
    EXPECT_TRUE(select_kernel(shape(4096, 128), tf32, 9, 0).sm90_bwd);
    EXPECT_TRUE(select_kernel(shape(4096, 128), tf32, 9, 0).tf32_dkv_wgmma);  // (no mma.sync dK/dV variant there)
    EXPECT_FALSE(select_kernel(shape(4096, 256), tf32, 9, 0).sm90_bwd);
    EXPECT_TRUE(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).f32_pair);  // 3xTF32: unaffected
  }
  {
    // The fp32-accurate wgmma forward: the default at padded D = 64 and 128 on 9.0 only;
    // FLASHATTN_CUDA_FP32_FWD=mma keeps the mma.sync kernel.
    const KernelChoice c = select_kernel(shape(4096, 128), num(DType::Float32), 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_fwd);
    EXPECT_TRUE(select_kernel(shape(4096, 97), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_TRUE(select_kernel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_TRUE(select_kernel(shape(1024, 40), num(DType::Float32), 9, 0).sm90_fwd);  // padded to 64
    EXPECT_FALSE(select_kernel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_FALSE(select_kernel(shape(4096, 128), num(DType::Float32), 8, 0).sm90_fwd);
    {
      EnvScope e("FLASHATTN_CUDA_FP32_FWD", "mma");
      EXPECT_FALSE(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_fwd);
      EXPECT_FALSE(select_kernel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_fwd);
    }
    EnvScope e("FLASHATTN_CUDA_FP32_FWD", "wgmma");
    for (int64_t d : {1, 40, 64, 128}) EXPECT_TRUE(select_kernel(shape(4096, d), num(DType::Float32), 9, 0).sm90_fwd) << d;
    EXPECT_FALSE(select_kernel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_FALSE(select_kernel(shape(4096, 64), num(DType::Float32), 8, 0).sm90_fwd);
  }
  {
    // The pair kernels: the default at padded D = 128, a choice at 64.
    EXPECT_TRUE(select_kernel(shape(4096, 128), tf32, 9, 0).f32_pair);
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).f32_pair);
    EnvScope e("FLASHATTN_CUDA_TF32_BWD", "pair");
    const KernelChoice c = select_kernel(shape(4096, 64), tf32, 9, 0);
    EXPECT_TRUE(c.sm90_bwd && c.tf32_dkv_wgmma && c.f32_pair);
    EXPECT_FALSE(select_kernel(shape(4096, 256), tf32, 9, 0).f32_pair);
  }
  {
    // The fp32-accurate wgmma backward: the default at padded D = 64 and 128 on 9.0 only (the
    // pair kernels).
    const KernelChoice c = select_kernel(shape(4096, 64), num(DType::Float32), 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_bwd && c.tf32_dkv_wgmma && c.f32_pair);
    EXPECT_TRUE(c.sm90_fwd);  // the 3xTF32 wgmma forward (the default there too)
    for (int64_t d : {65, 100, 128}) {
      const KernelChoice c128 = select_kernel(shape(4096, d), num(DType::Float32), 9, 0);
      EXPECT_TRUE(c128.sm90_bwd && c128.tf32_dkv_wgmma && c128.f32_pair) << "D = " << d;
    }
    EXPECT_FALSE(select_kernel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_bwd);
    EXPECT_FALSE(select_kernel(shape(4096, 64), num(DType::Float32), 8, 0).sm90_bwd);
    EnvScope e("FLASHATTN_CUDA_FP32_BWD", "mma");
    EXPECT_FALSE(select_kernel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_bwd);
    EXPECT_FALSE(select_kernel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_bwd);
  }
  {
    EnvScope e("FLASHATTN_CUDA_TF32_BWD", "mma");
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(select_kernel(shape(4096, 128), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(select_kernel(shape(4096, 64), tf32, 9, 0).tf32_dkv_wgmma);
  }
  // Before sm_80 there is no TF32: the FMA kernels in both precisions; asking for TF32 is an error.
  EXPECT_EQ(select_kernel(shape(4096, 64), num(DType::Float32, Mask::None, Precision::Tf32), 7, 5).math, Math::Fma);
  EnvScope e("FLASHATTN_CUDA_MATH", "tf32");
  const KernelChoice old = select_kernel(shape(4096, 64), num(DType::Float32), 7, 5);
  EXPECT_FALSE(old.ok);
  EXPECT_NE(old.why.find("sm_80"), std::string::npos) << old.why;
}

// The tf32 sm_90a forward's operand copies: V transposed by the pre-pass once 256 query rows see
// each key (Sq x the GQA group, halved under a causal mask), K rounded there too from 2048.
TEST(CudaSelect, Tf32ForwardCopies) {
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  const Numerics tf32c = num(DType::Float32, Mask::CausalTopLeft, Precision::Tf32);
  EXPECT_EQ(select_kernel(shape(1024, 128), tf32, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(select_kernel(shape(2048, 128), tf32, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(select_kernel(shape(2048, 64), tf32c, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(select_kernel(shape(4096, 64), tf32c, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(select_kernel(shape(16384, 128), tf32, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(select_kernel(shape(256, 64), tf32, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(select_kernel(shape(255, 64), tf32, 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(select_kernel(shape(256, 64), tf32c, 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(select_kernel(shape(512, 64), tf32c, 9, 0).tf32_fwd_copies, 1);
  Shape gqa = shape(1024, 128);
  gqa.heads_kv = gqa.heads_q / 2;
  EXPECT_EQ(select_kernel(gqa, tf32, 9, 0).tf32_fwd_copies, 2);  // each key seen by 2 x 1024 rows
  // Only the tf32 sm_90a forward has them.
  EXPECT_EQ(select_kernel(shape(16384, 128), num(DType::Float32), 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(select_kernel(shape(16384, 128), tf32, 8, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(select_kernel(shape(16384, 256), tf32, 9, 0).tf32_fwd_copies, 0);
  {
    EnvScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "none");
    EXPECT_EQ(select_kernel(shape(16384, 128), tf32, 9, 0).tf32_fwd_copies, 0);
  }
  {
    EnvScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "kv");
    EXPECT_EQ(select_kernel(shape(128, 64), tf32c, 9, 0).tf32_fwd_copies, 2);
  }
  EnvScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "bogus");
  try {
    (void)select_kernel(shape(1024, 64), tf32, 9, 0);
    ADD_FAILURE() << "FLASHATTN_CUDA_TF32_FWD_COPIES=bogus was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(err.what()).find("FLASHATTN_CUDA_TF32_FWD_COPIES"), std::string::npos) << err.what();
  }
}

TEST(CudaSelect, UnsupportedProblemsSayWhy) {
  const KernelChoice old16 = select_kernel(shape(128, 64), num(DType::Float16), 7, 5);
  EXPECT_FALSE(old16.ok);
  EXPECT_NE(old16.why.find("sm_80"), std::string::npos) << old16.why;
  EXPECT_NE(old16.why.find("float16"), std::string::npos) << old16.why;
  const KernelChoice wide = select_kernel(shape(128, 300), num(DType::BFloat16), 9, 0);
  EXPECT_FALSE(wide.ok);
  EXPECT_NE(wide.why.find("300"), std::string::npos) << wide.why;
  const KernelChoice f64 = select_kernel(shape(128, 64), num(DType::Float64), 9, 0);
  EXPECT_FALSE(f64.ok);
  EXPECT_NE(f64.why.find("float64"), std::string::npos) << f64.why;
}

TEST(CudaSelect, UnknownOverrideValuesAreErrorsNamingTheVariable) {
  for (const char* var : {"FLASHATTN_CUDA_MATH", "FLASHATTN_CUDA_BWD", "FLASHATTN_CUDA_ARCH", "FLASHATTN_CUDA_SM90_VARIANT"}) {
    EnvScope e(var, "bogus");
    try {
      (void)select_kernel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0);
      (void)select_kernel(shape(512, 64), num(DType::Float32), 9, 0);
      ADD_FAILURE() << var << "=bogus was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.status(), Status::InvalidArgument) << var;
      EXPECT_NE(std::string(err.what()).find(var), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("bogus"), std::string::npos) << err.what();
    }
  }
}

TEST(CudaSelect, PingPongRule) {
  EXPECT_TRUE(use_pingpong(shape(16384, 64), 64));
  EXPECT_TRUE(use_pingpong(shape(4096, 128), 128));
  EXPECT_FALSE(use_pingpong(shape(8192, 128), 128));
  EXPECT_FALSE(use_pingpong(shape(512, 256, 8192), 256));
  EnvScope e("FLASHATTN_CUDA_PINGPONG", "1");
  EXPECT_TRUE(use_pingpong(shape(8192, 128), 128));
}

TEST(CudaSelect, PersistentCtas) {
  // By default one CTA per block; the override runs a count, one per multiprocessor, or one per
  // block (0).
  EXPECT_EQ(persistent_ctas(1000, 132), 1000);
  EXPECT_EQ(persistent_ctas(17, 132), 17);
  EXPECT_EQ(persistent_ctas(0, 132), 1);
  {
    EnvScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "sms");
    EXPECT_EQ(persistent_ctas(1000, 132), 132);
    EXPECT_EQ(persistent_ctas(17, 132), 17);
  }
  {
    EnvScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "3");
    EXPECT_EQ(persistent_ctas(1000, 132), 3);
    EXPECT_EQ(persistent_ctas(2, 132), 2);
  }
  {
    EnvScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "0");
    EXPECT_EQ(persistent_ctas(1000, 132), 1000);
  }
  EnvScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "many");
  try {
    persistent_ctas(1000, 132);
    ADD_FAILURE() << "no error";
  } catch (const Error& x) {
    EXPECT_NE(std::string(x.what()).find("FLASHATTN_CUDA_PERSISTENT_CTAS"), std::string::npos) << x.what();
  }
}

}  // namespace
}  // namespace flashattn::cuda
