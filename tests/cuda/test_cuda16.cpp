// The CUDA backend's float16 / bfloat16 kernels against the float64 reference, forward (out, lse)
// and backward (dq, dk, dv) in the three backward designs: split (deterministic = 1 with
// FLASHATTN_CUDA_BWD=split: a dQ pass and a dK/dV pass), atomic (deterministic = 0 with
// FLASHATTN_CUDA_BWD=atomic: one pass, dQ summed by float32 atomics) and ordered (deterministic = 1,
// the default there: the sm_90a single pass with dQ added in a fixed key-block order).
//
// Accuracy criterion (FlashAttention's): on the same 16-bit inputs,
//   max|got - ref64| <= 2 x max|naive - ref64|   for out
//   max|got - ref64| <= 3 x max|naive - ref64|   for dq, dk, dv
// where ref64 is the float64 reference (src/testing/reference.hpp) and naive is plain attention as
// PyTorch's eager mode computes it in the same 16-bit type (src/testing/naive_lowp.hpp). Both
// bounds have a floor for problems where the naive is exact or lucky (see Bounds). lse (float32
// for every dtype) gets a fixed tolerance (kLseTol). Rows that see no key must give exactly
// out = 0, lse = -inf, dq = 0, and keys no query sees exactly dk = dv = 0.
//
// Device outputs are poisoned with NaN before every run and every element is checked; NaN never
// passes. Without a CUDA device every test reports SKIPPED.
//
// Filters: the full suite is flashattn_cuda_tests16 (about a minute or two, mostly the float64
// reference on the CPU); 'Small16/CudaSanitize16.*' is the reduced set for compute-sanitizer.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/mask.hpp"
#include "cuda_test_util.hpp"
#include "testing/naive_lowp.hpp"
#include "testing/parallel.hpp"

namespace flashattn::test {
namespace {

constexpr DType kDtypes16[] = {DType::BFloat16, DType::Float16};
constexpr const char* kNames[5] = {"out", "lse", "dq", "dk", "dv"};

// lse is float32 for every dtype and the kernels compute scores and row sums in float32, so
// their lse is ~1e-6 relative to max|lse| (rounding of float32 sums and of the exponential); the
// naive's, from 16-bit scores, is ~2^-9 (bf16) / 2^-12 (fp16) relative, too loose a yardstick.
// 1e-3 relative to max(1, max|lse|) still leaves room for a kernel that sums the 16-bit-rounded
// P (up to 2^-9 relative in the sum, i.e. 2e-3 absolute, against max|lse| ~ log(Skv) + max score
// of several units), and catches what matters for the backward, which recomputes
// P = exp(S - lse): an lse off by e makes every P of its row off by e relative, and the checks of
// dq, dk, dv hold those to the naive's error (~2^-9 / 2^-12 relative) anyway.
constexpr double kLseTol = 1e-3;

// Significand bits (with the implicit one): a correctly rounded value x is off by at most
// 2^-bits * |x|.
int significand_bits(DType d) { return d == DType::BFloat16 ? 8 : 11; }

const char* short_dtype(DType d) { return d == DType::BFloat16 ? "bf16" : "fp16"; }

// ---- what each output should be -------------------------------------------------------------

// The float64 reference and the 16-bit naive on the problem's stored (rounded) inputs, all
// logical [B,H,S,D] / [B,H,Sq]: index 0..4 = out, lse, dq, dk, dv.
struct Expected {
  std::vector<double> ref[5], naive[5];
  double naive_err[5] = {0, 0, 0, 0, 0};  // max |naive - ref|
  double max_ref[5] = {0, 0, 0, 0, 0};    // max |ref| (finite entries)
  double grad_scale = 0;                  // max of max_ref over dq, dk, dv
};

// The reference per query head on all cores (testing::reference_* is one plain loop nest, the
// suite's main cost at Sq = Skv = 1031); dk, dv summed over each kv group afterwards, in double.
void reference_parallel(const Problem& p, Expected& e) {
  const ProblemConfig& c = p.cfg;
  const int64_t Sq = c.seq_q, Skv = c.seq_kv, D = c.head_dim, group = c.heads_q / c.heads_kv;
  const auto q = p.to_double(p.q), k = p.to_double(p.k), v = p.to_double(p.v),
             dout = p.to_double(p.dout);
  const double scale = static_cast<double>(c.scale());
  const int64_t heads = c.batch * c.heads_q;
  for (int i : {0, 2}) e.ref[i].assign(q.size(), 0.0);
  e.ref[1].assign(heads * Sq, 0.0);
  std::vector<std::vector<double>> dk_h(heads), dv_h(heads);
  testing::parallel_for(heads, testing::resolve_threads(0), [&](int64_t bh) {
    const int64_t kvh = (bh / c.heads_q) * c.heads_kv + (bh % c.heads_q) / group;
    const int64_t qo = bh * Sq * D, ko = kvh * Skv * D;
    const std::vector<double> qh(q.begin() + qo, q.begin() + qo + Sq * D),
        oh(dout.begin() + qo, dout.begin() + qo + Sq * D),
        kh(k.begin() + ko, k.begin() + ko + Skv * D), vh(v.begin() + ko, v.begin() + ko + Skv * D);
    const testing::RefShape one{1, 1, 1, Sq, Skv, D};
    const testing::RefForward f = testing::reference_forward(one, qh, kh, vh, scale, c.mask);
    testing::RefBackward b = testing::reference_backward(one, qh, kh, vh, oh, scale, c.mask);
    std::copy(f.out.begin(), f.out.end(), e.ref[0].begin() + qo);
    std::copy(f.lse.begin(), f.lse.end(), e.ref[1].begin() + bh * Sq);
    std::copy(b.dq.begin(), b.dq.end(), e.ref[2].begin() + qo);
    dk_h[bh] = std::move(b.dk);
    dv_h[bh] = std::move(b.dv);
  });
  for (int i : {3, 4}) e.ref[i].assign(k.size(), 0.0);
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t ko = ((bh / c.heads_q) * c.heads_kv + (bh % c.heads_q) / group) * Skv * D;
    for (int64_t x = 0; x < Skv * D; ++x) {
      e.ref[3][ko + x] += dk_h[bh][x];
      e.ref[4][ko + x] += dv_h[bh][x];
    }
  }
}

Expected expected_for(const Problem& p) {
  Expected e;
  reference_parallel(p, e);
  const ProblemConfig& c = p.cfg;
  auto to_float = [&](const testing::HostTensor& t) {
    const std::vector<double> d = p.to_double(t);
    return std::vector<float>(d.begin(), d.end());  // exact: the values are 16-bit
  };
  const std::vector<float> q = to_float(p.q), k = to_float(p.k), v = to_float(p.v),
                           dout = to_float(p.dout);
  const testing::LowpResult n = testing::naive_lowp(
      testing::LowpShape{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, c.head_dim}, c.dtype,
      q.data(), k.data(), v.data(), dout.data(), c.scale(), c.mask);
  const std::vector<float>* ns[5] = {&n.out, &n.lse, &n.dq, &n.dk, &n.dv};
  for (int i = 0; i < 5; ++i) {
    e.naive[i].assign(ns[i]->begin(), ns[i]->end());
    const testing::ErrorStats s = testing::compare(e.naive[i], e.ref[i]);
    // The baseline itself must be sound: no NaN, -inf exactly where the reference has it.
    EXPECT_EQ(0, s.nan) << "naive " << kNames[i] << " " << c.describe();
    e.naive_err[i] = s.max_abs;
    e.max_ref[i] = s.max_ref;
  }
  e.grad_scale = std::max({e.max_ref[2], e.max_ref[3], e.max_ref[4]});
  return e;
}

// The bound on max|got - ref| for output i (not lse).
//   factor x max(naive error, floor), factor 2 for out and 3 for dq, dk, dv (FlashAttention's).
// The floor matters only where the naive is exact or lucky (few elements, e.g. Sq = Skv = 1 or
// D = 1), never on problems of any size, where the naive's error is many times above it:
//   2^-bits x max|ref|: the rounding of one output element to the 16-bit type, which even an
//     exact kernel pays (half an ulp of the largest element, up to 2^-8 relative in bfloat16 and
//     2^-11 in float16); a smaller floor fails exact kernels whenever the naive rounds luckily.
//   2^-16 x (largest gradient) for dq, dk, dv: a row with one visible key has dq = 0 exactly
//     (and dk = 0 for keys seen only by such rows): the naive computes dS = P (dP - P dP) = 0 to
//     the bit, the kernels dS = P (dP - rowsum(dO O)) in float32, a difference of two float32
//     sums of O(|dO| |V|) terms, ~1e-6 of the gradients' scale. A real error there (a wrong
//     row, mask or scale) is O(1) of that scale, 65536 times the floor.
double bound(const Expected& e, int i, DType dt) {
  const double factor = i == 0 ? 2.0 : 3.0;
  double floor = std::ldexp(e.max_ref[i], -significand_bits(dt));
  if (i >= 2) floor += std::ldexp(e.grad_scale, -16);
  return factor * std::max(e.naive_err[i], floor);
}

double lse_bound(const Expected& e) { return kLseTol * std::max(1.0, e.max_ref[1]); }

// Exact values forced by the mask: out = 0 and dq = 0 on rows that see no key (lse = -inf is
// checked by compare()), dk = dv = 0 on keys that no query sees. Returns the number of elements
// of got[first..last] (out, lse, dq, dk, dv) that differ.
int64_t mask_violations(const ProblemConfig& c, const std::vector<double>* got, int first,
                        int last) {
  const MaskRule rule = make_mask_rule(static_cast<int32_t>(c.mask), c.seq_q, c.seq_kv);
  const int64_t D = c.head_dim;
  int64_t bad = 0;
  for (int64_t bh = 0; bh < c.batch * c.heads_q; ++bh)
    for (int64_t i = 0; i < c.seq_q; ++i) {
      if (rule.key_end(i, c.seq_kv) != 0) continue;
      for (int t : {0, 2})
        if (t >= first && t <= last)
          for (int64_t x = 0; x < D; ++x) bad += got[t][(bh * c.seq_q + i) * D + x] != 0.0;
    }
  for (int64_t bh = 0; bh < c.batch * c.heads_kv; ++bh)
    for (int64_t j = 0; j < c.seq_kv; ++j) {
      if (rule.first_row(j, c.seq_q) != c.seq_q) continue;
      for (int t : {3, 4})
        if (t >= first && t <= last)
          for (int64_t x = 0; x < D; ++x) bad += got[t][(bh * c.seq_kv + j) * D + x] != 0.0;
    }
  return bad;
}

// ---- running the kernels ---------------------------------------------------------------------

struct Design {
  const char* name;
  bool deterministic;
  const char* env;                 // FLASHATTN_CUDA_BWD
  const char* ord_heads = nullptr;     // FLASHATTN_CUDA_ORD_HEADS
  const char* atomic_heads = nullptr;  // FLASHATTN_CUDA_ATOMIC_HEADS
};
// "ordered": deterministic on the sm_90a single pass, dQ added in key-block order (deterministic = 1
// with no knob; the split passes where that kernel does not run: sm_80, D = 96, the per-entry step);
// under GQA a CTA per (key block, query head), the group's dK/dV summed in head order.
// "ordered-kvhead" / "ordered-heads": the same with that head split never / always (every dense
// GQA case, also without a mask, where it meets the rotated dQ turns). "atomic": the default
// design with its own head-split rule (split or not by mask, D and length: both forms run in the
// grid). "atomic-heads": that head split on every dense GQA case (FLASHATTN_CUDA_ATOMIC_HEADS=1).
constexpr Design kDesigns[] = {{"split", true, "split"},
                               {"atomic", false, "atomic"},
                               {"ordered", true, nullptr},
                               {"ordered-kvhead", true, nullptr, "0"},
                               {"ordered-heads", true, nullptr, "1"},
                               {"atomic-heads", false, "atomic", nullptr, "1"}};

Options options16(const ProblemConfig& c, const Design& d) {
  Options o = options_for(c);
  o.deterministic = d.deterministic;
  return o;
}

// Calls f; a flashattn::Error becomes a test failure naming the call (Unsupported until the
// 16-bit kernels exist) and false.
template <class F>
bool call(const char* what, const std::string& info, F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    ADD_FAILURE() << what << " threw (status " << static_cast<int>(e.status()) << "): " << e.what()
                  << "\n" << info;
    return false;
  }
}

// One line per tensor for the logs: error, its bound, and the ratio to the naive's error.
struct Report {
  std::ostringstream os;
  void add(const char* design, int i, double err, double naive, double bnd) {
    os << " " << design << ":" << kNames[i] << " " << err << "/" << bnd;
    if (i != 1) os << " (" << (naive > 0 ? err / naive : 0.0) << "x naive)";
  }
};

// Checks got[first..last] (out, lse, dq, dk, dv) against `e`.
void check_tensors(const ProblemConfig& c, const Expected& e, const std::vector<double>* got,
                   int first, int last, const char* design, const std::string& info, Report& rep) {
  for (int i = first; i <= last; ++i) {
    const testing::ErrorStats s = testing::compare(got[i], e.ref[i]);
    const double b = i == 1 ? lse_bound(e) : bound(e, i, c.dtype);
    rep.add(design, i, s.max_abs, e.naive_err[i], b);
    EXPECT_EQ(0, s.nan) << design << " " << kNames[i] << ": NaN / inf / unwritten elements\n"
                        << info;
    EXPECT_LE(s.max_abs, b) << design << " " << kNames[i] << ": " << s.str() << ", naive max_abs "
                            << e.naive_err[i] << "\n" << info;
  }
  EXPECT_EQ(0, mask_violations(c, got, first, last))
      << design << ": elements not exactly 0 on fully masked rows / unseen keys\n" << info;
}

// Forward once, then the backward in each design (gradients re-poisoned in between) on a device
// copy `d` of `p` (DeviceProblem or PaddedDeviceProblem). out and lse must survive each backward
// bit for bit, and the inputs every call.
template <class Dev>
void run_and_check(Problem& p, Dev& d, const Expected& e, const char* label = "") {
  const ProblemConfig& c = p.cfg;
  const std::string info = std::string(label) + c.describe();
  Report rep;
  std::vector<double> got[5];
  // Both forward families where the device has two: the mma.sync kernels (FLASHATTN_CUDA_ARCH=sm80)
  // and the default (the sm_90a wgmma kernels on compute capability 9.0), the latter last so that
  // the backward below starts from the default forward's out and lse. Between them the sm_90a
  // forward with 3 CTAs walking all row blocks (FLASHATTN_CUDA_FWD_CTAS; blocks of every length,
  // none under a mask, in one CTA's pipeline): the same products per block, so the same bits as
  // one CTA per block.
  struct Fwd {
    const char *arch, *ctas, *name;
  };
  std::vector<unsigned char> walk_out, walk_lse, block_out, block_lse;
  for (const Fwd f : {Fwd{"sm80", nullptr, "fwd80"}, Fwd{nullptr, "3", "fwd-walk3"}, Fwd{nullptr, "0", "fwd-blocks"},
                      Fwd{nullptr, nullptr, "fwd"}}) {
    EnvScope env("FLASHATTN_CUDA_BWD", nullptr);
    EnvScope env_arch("FLASHATTN_CUDA_ARCH", f.arch);
    EnvScope env_ctas("FLASHATTN_CUDA_FWD_CTAS", f.ctas);
    d.poison_outputs();
    if (!call("forward", info, [&] { d.forward(options16(c, kDesigns[0])); })) return;
    p.poison_outputs();
    d.download();
    for (int i : {0, 1}) got[i] = p.to_double(i == 0 ? p.out : p.lse);
    check_tensors(c, e, got, 0, 1, f.name, info, rep);
    if (f.ctas != nullptr) {
      (f.ctas[0] == '3' ? walk_out : block_out) = p.out.bytes;
      (f.ctas[0] == '3' ? walk_lse : block_lse) = p.lse.bytes;
    }
  }
  EXPECT_TRUE(walk_out == block_out && walk_lse == block_lse)
      << "the forward walked by 3 CTAs differs from one CTA per row block\n" << info;
  const std::vector<unsigned char> out_bytes = p.out.bytes, lse_bytes = p.lse.bytes;
  for (const Design& des : kDesigns) {
    EnvScope env("FLASHATTN_CUDA_BWD", des.env);
    EnvScope env_heads("FLASHATTN_CUDA_ORD_HEADS", des.ord_heads);
    EnvScope env_aheads("FLASHATTN_CUDA_ATOMIC_HEADS", des.atomic_heads);
    d.poison_grads();
    if (!call(des.name, info, [&] { d.backward(options16(c, des)); })) continue;
    p.poison_outputs();
    d.download();
    got[2] = p.to_double(p.dq);
    got[3] = p.to_double(p.dk);
    got[4] = p.to_double(p.dv);
    check_tensors(c, e, got, 2, 4, des.name, info, rep);
    EXPECT_TRUE(p.out.bytes == out_bytes && p.lse.bytes == lse_bytes)
        << des.name << ": the backward wrote to out or lse\n" << info;
  }
  EXPECT_TRUE(d.inputs_unchanged()) << "q, k, v or dout was modified\n" << info;
  // Printed so the logs show each margin (error / bound; x naive) for docs and tuning.
  std::printf("[ ACCURACY16 ] %s |%s\n", info.c_str(), rep.os.str().c_str());
}

void check_problem(const ProblemConfig& cfg) {
  Problem p(cfg);
  const Expected e = expected_for(p);
  DeviceProblem d(p);
  ASSERT_TRUE(d.ok()) << "cudaMalloc failed";
  run_and_check(p, d, e);
}

// ---- the grid --------------------------------------------------------------------------------
// dtypes bf16, fp16; head dims 64, 96, 128, 256 (compiled) and 1, 17, 59, 111, 200 (padded);
// lengths 1, 17, 97, 128, 1031 with Sq != Skv both ways; masks none / causal top-left / causal
// bottom-right; (Hq, Hkv) in {(1,1), (4,2), (6,1)}; B in {1, 2}; layouts BHSD, BSHD. Sampled:
// every head dim meets every mask in both dtypes (54 cases), the layout alternates with dtype and
// head dim so every (dtype, mask, layout) occurs; lengths, heads and batch rotate with periods
// 11, 3 and 6. Long pairs (Sq * Skv > 60000) run with B = 1 and at most 2 query heads; the
// hand-picked cases add the long square problems, many fully masked rows, many unseen keys,
// D = 256 with MQA, and softmax scales other than 1/sqrt(D).
struct Case16 {
  ProblemConfig cfg;
  std::string name;
};

void PrintTo(const Case16& c, std::ostream* os) { *os << c.cfg.describe(); }

std::string case_name(const ProblemConfig& c) {
  std::ostringstream n;
  n << short_dtype(c.dtype) << "_D" << c.head_dim << "_" << mask_name(c.mask) << "_"
    << testing::layout_name(c.layout) << "_B" << c.batch << "_H" << c.heads_q << "x" << c.heads_kv
    << "_S" << c.seq_q << "x" << c.seq_kv;
  return n.str();
}

std::vector<Case16> grid16_cases() {
  const int64_t dims[] = {1, 17, 59, 64, 96, 111, 128, 200, 256};
  const int64_t heads[][2] = {{1, 1}, {4, 2}, {6, 1}};
  const int64_t lens[][2] = {{1, 1},   {17, 97},  {97, 17},  {128, 128}, {1, 17},   {1031, 97},
                             {97, 128}, {17, 1},  {128, 97}, {97, 1031}, {17, 17}};
  const Mask masks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight};
  std::vector<Case16> out;
  int i = 0;
  for (int di = 0; di < 9; ++di)
    for (const Mask m : masks)
      for (int t = 0; t < 2; ++t, ++i) {
        ProblemConfig c;
        c.dtype = kDtypes16[t];
        c.head_dim = dims[di];
        c.mask = m;
        c.layout = (t + di) % 2 ? testing::Layout::BSHD : testing::Layout::BHSD;
        c.heads_q = heads[i % 3][0];
        c.heads_kv = heads[i % 3][1];
        c.seq_q = lens[i % 11][0];
        c.seq_kv = lens[i % 11][1];
        c.batch = (i / 3) % 2 ? 2 : 1;
        if (c.seq_q * c.seq_kv > 60000) {  // long: keep the float64 reference cheap
          c.batch = 1;
          c.heads_kv = 1;
          c.heads_q = c.heads_q > 1 ? 2 : 1;
        }
        c.seed = 1600 + static_cast<uint64_t>(i);
        out.push_back({c, case_name(c)});
      }
  auto add = [&](DType dt, int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t d,
                 Mask m, testing::Layout l, float scale, const char* name) {
    const ProblemConfig c =
        make_config(b, hq, hkv, sq, skv, d, m, dt, l, scale, 1700 + out.size());
    out.push_back({c, std::string(name) + "_" + case_name(c)});
  };
  using L = testing::Layout;
  const DType bf = DType::BFloat16, fp = DType::Float16;
  add(bf, 1, 4, 2, 1031, 1031, 128, Mask::CausalBottomRight, L::BSHD, 0, "long");
  add(fp, 1, 6, 1, 1031, 1031, 64, Mask::CausalTopLeft, L::BHSD, 0, "long");
  add(fp, 1, 2, 2, 1031, 1000, 256, Mask::None, L::BSHD, 0, "long");
  add(bf, 1, 6, 1, 1031, 1031, 256, Mask::CausalBottomRight, L::BHSD, 0, "long");
  add(bf, 2, 4, 2, 1031, 97, 96, Mask::CausalBottomRight, L::BHSD, 0, "masked_rows");
  add(fp, 1, 6, 1, 300, 17, 200, Mask::CausalBottomRight, L::BSHD, 0, "masked_rows");
  add(fp, 1, 4, 2, 97, 1031, 256, Mask::CausalTopLeft, L::BHSD, 0, "unseen_keys");
  add(bf, 2, 2, 1, 17, 300, 59, Mask::CausalTopLeft, L::BSHD, 0, "unseen_keys");
  add(bf, 2, 6, 1, 128, 128, 256, Mask::CausalBottomRight, L::BHSD, 0, "mqa");
  add(fp, 2, 6, 1, 128, 128, 256, Mask::None, L::BSHD, 0, "mqa");
  add(fp, 1, 4, 2, 97, 128, 96, Mask::None, L::BSHD, 0.37f, "scale");
  add(bf, 1, 4, 4, 128, 97, 64, Mask::CausalTopLeft, L::BHSD, 1.0f, "peaked");
  add(fp, 3, 2, 1, 97, 97, 17, Mask::CausalBottomRight, L::BSHD, -0.25f, "negative_scale");
  return out;
}

class Cuda16VsReference : public ::testing::TestWithParam<Case16> {};

TEST_P(Cuda16VsReference, ForwardBackwardBothDesigns) {
  REQUIRE_GPU();
  check_problem(GetParam().cfg);
}

INSTANTIATE_TEST_SUITE_P(Grid16, Cuda16VsReference, ::testing::ValuesIn(grid16_cases()),
                         [](const ::testing::TestParamInfo<Case16>& i) { return i.param.name; });

// ---- small problems for compute-sanitizer (memcheck, racecheck) ------------------------------
// Every compiled head dim and a padded one, both dtypes, every mask, both layouts, GQA, both
// backward designs; lengths that cross the kernels' 128-row blocks, and fully masked rows.
class CudaSanitize16 : public ::testing::TestWithParam<Case16> {};
TEST_P(CudaSanitize16, BothDesigns) {
  REQUIRE_GPU();
  check_problem(GetParam().cfg);
}
std::vector<Case16> sanitize16_cases() {
  using L = testing::Layout;
  const ProblemConfig cs[] = {
      make_config(1, 2, 1, 150, 70, 64, Mask::CausalBottomRight, DType::BFloat16, L::BHSD, 0, 81),
      make_config(1, 2, 1, 70, 150, 96, Mask::None, DType::Float16, L::BSHD, 0, 82),
      make_config(1, 2, 1, 137, 137, 128, Mask::CausalTopLeft, DType::BFloat16, L::BSHD, 0, 83),
      make_config(1, 2, 1, 33, 140, 256, Mask::CausalBottomRight, DType::Float16, L::BHSD, 0, 84),
      make_config(1, 2, 1, 140, 33, 17, Mask::CausalTopLeft, DType::Float16, L::BHSD, 0, 85),
      make_config(1, 2, 1, 129, 65, 256, Mask::None, DType::BFloat16, L::BSHD, 0, 86),
      // The D = 64 case's shape (fully masked rows, a 22-row CTA) at D = 128: racecheck once
      // reported hazards in the sm_90a kernels at D = 64 only, so the shape runs at D = 128 too
      // (history: docs/perf-log/cuda-16bit.md, racecheck note).
      make_config(1, 2, 1, 150, 70, 128, Mask::CausalBottomRight, DType::BFloat16, L::BHSD, 0, 87),
  };
  std::vector<Case16> out;
  for (const ProblemConfig& c : cs) out.push_back({c, case_name(c)});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Small16, CudaSanitize16, ::testing::ValuesIn(sanitize16_cases()),
                         [](const ::testing::TestParamInfo<Case16>& i) { return i.param.name; });

// ---- determinism -----------------------------------------------------------------------------
// deterministic = 1 with FLASHATTN_CUDA_BWD=split: forward and split backward bitwise identical run
// to run on a long GQA problem (many key blocks per dQ row, two query heads per kv head).
TEST(Cuda16Determinism, SplitBackwardBitwiseAcrossRuns) {
  REQUIRE_GPU();
  for (const DType dt : kDtypes16) {
    const ProblemConfig c = make_config(1, 4, 2, 1031, 1031, 128, Mask::CausalBottomRight, dt,
                                        testing::Layout::BSHD, 0, 31);
    Problem p(c);
    DeviceProblem d(p);
    ASSERT_TRUE(d.ok());
    const Options o = options16(c, kDesigns[0]);
    std::vector<Snapshot> runs;
    const char* const envs[] = {"split", "split", "split"};
    for (const char* env : envs) {
      EnvScope scope("FLASHATTN_CUDA_BWD", env);
      d.poison();
      if (!call("forward", c.describe(), [&] { d.forward(o); })) return;
      if (!call("backward", c.describe(), [&] { d.backward(o); })) return;
      p.poison_outputs();
      d.download();
      runs.push_back(snapshot(p));
      if (runs.size() == 1) {  // identical NaN would be identical too: require finite outputs
        for (const testing::HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv}) {
          const std::vector<double> x = p.to_double(*t);
          EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double y) { return std::isfinite(y); }))
              << short_dtype(dt) << ": non-finite output";
        }
      }
    }
    for (size_t r = 1; r < runs.size(); ++r)
      for (int t = 4; t < 9; ++t)  // snapshot order: q k v dout out lse dq dk dv
        EXPECT_TRUE(runs[0].bytes[t] == runs[r].bytes[t])
            << short_dtype(dt) << " run " << r << ": " << kNames[t - 4] << " differs from run 0";
  }
}

// ---- outputs under each value of a knob -----------------------------------------------------
// Checks that a developer knob (an environment variable the library reads per call) changes how
// the work is done but not one bit of the result: the problem's outputs once per value, each run
// on NaN-poisoned outputs, compared bitwise with the first run's.
struct KnobShape {
  int64_t b, hq, hkv, sq, skv, d;
  Mask mask;
  int64_t wl, wr;
};
ProblemConfig knob_config(const KnobShape& sh, DType dt, testing::Layout layout, uint64_t seed) {
  ProblemConfig c = make_config(sh.b, sh.hq, sh.hkv, sh.sq, sh.skv, sh.d, sh.mask, dt, layout, 0, seed);
  c.window_left = sh.wl;
  c.window_right = sh.wr;
  return c;
}
// The snapshots (order: q k v dout out lse dq dk dv) of `pass` (true when its calls succeeded) run
// once per value of `var` (nullptr: unset); empty when a call failed (call() has said so).
template <class Pass>
std::vector<Snapshot> snapshots_under(Problem& p, DeviceProblem& d, const char* var,
                                      std::initializer_list<const char*> values, Pass&& pass) {
  std::vector<Snapshot> runs;
  for (const char* env : values) {
    EnvScope scope(var, env);
    d.poison();
    if (!pass()) return {};
    p.poison_outputs();
    d.download();
    runs.push_back(snapshot(p));
  }
  return runs;
}
// Snapshot entries [first, last) of every run equal to run 0's, and `finite` (a host tensor of
// the problem) finite: identical NaN would be identical too, and poison left unwritten is NaN.
void expect_runs_bitwise(const Problem& p, const std::vector<Snapshot>& runs, int first, int last,
                         const testing::HostTensor& finite, const char* what) {
  ASSERT_FALSE(runs.empty());
  const std::vector<double> x = p.to_double(finite);
  EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double y) { return std::isfinite(y); }))
      << "non-finite or unwritten output";
  for (size_t r = 1; r < runs.size(); ++r)
    for (int t = first; t < last; ++t)
      EXPECT_TRUE(runs[0].bytes[t] == runs[r].bytes[t]) << "run " << r << ": " << kNames[t - 4] << " " << what;
}

// Every shape in both 16-bit dtypes: `pass(d, o)` run under each value of `var`, snapshot entries
// [first, last) bitwise equal across the values and `finite` (a member of Problem) finite.
template <class Pass>
void check_bitwise_under_knob(std::initializer_list<KnobShape> shapes, testing::Layout layout, uint64_t seed,
                              const Design& design, const char* var, std::initializer_list<const char*> values,
                              int first, int last, testing::HostTensor Problem::*finite, const char* what,
                              Pass&& pass) {
  for (const DType dt : kDtypes16)
    for (const KnobShape& sh : shapes) {
      const ProblemConfig c = knob_config(sh, dt, layout, seed);
      SCOPED_TRACE(c.describe());
      Problem p(c);
      DeviceProblem d(p);
      ASSERT_TRUE(d.ok());
      const Options o = options16(c, design);
      const auto runs = snapshots_under(p, d, var, values, [&] { return pass(c, d, o); });
      expect_runs_bitwise(p, runs, first, last, p.*finite, what);
    }
}

// The ordered single pass (deterministic = 1 on sm_90a, also with FLASHATTN_CUDA_BWD=ordered or
// =atomic set: deterministic wins): bitwise identical run to run on problems with many key blocks
// per query tile (GQA, causal, a window, Sq != Skv, every sm_90a head dim), where the unordered
// atomic design's dQ differs between runs.
TEST(Cuda16Determinism, OrderedBackwardBitwiseAcrossRuns) {
  REQUIRE_GPU();
  check_bitwise_under_knob({{1, 4, 2, 1031, 1031, 128, Mask::CausalBottomRight, -1, -1},
                            {1, 2, 1, 700, 1500, 64, Mask::None, -1, -1},
                            {1, 2, 2, 900, 600, 256, Mask::CausalTopLeft, -1, -1},
                            {1, 4, 1, 1100, 1100, 64, Mask::None, 200, 10}},
                           testing::Layout::BSHD, 37, kDesigns[2], "FLASHATTN_CUDA_BWD",
                           {nullptr, "ordered", "atomic"}, 4, 9, &Problem::dq,
                           "differs between runs of the deterministic backward",
                           [](const ProblemConfig& c, DeviceProblem& d, const Options& o) {
                             return call("forward", c.describe(), [&] { d.forward(o); }) &&
                                    call("backward", c.describe(), [&] { d.backward(o); });
                           });
}

// ---- the forward's walk at scale --------------------------------------------------------------
// Grids of more row blocks than the GPU has multiprocessors, where the library's own choice walks
// them (FwdWalk: one CTA per SM, units of two blocks): out and lse bitwise equal to one CTA per
// block (FLASHATTN_CUDA_FWD_CTAS=0), which the grid above checks against the float64 reference,
// and finite. Causal, no mask, a window, Sq != Skv, every sm_90a head dim, an odd row of blocks.
TEST(Cuda16Walk, DefaultWalkEqualsOneCtaPerBlock) {
  REQUIRE_GPU();
  check_bitwise_under_knob({{4, 16, 4, 1031, 1031, 128, Mask::CausalBottomRight, -1, -1},
                            {8, 8, 8, 700, 1500, 64, Mask::None, -1, -1},
                            {2, 16, 2, 1400, 1400, 256, Mask::CausalTopLeft, 300, -1},
                            {3, 32, 8, 2000, 1000, 64, Mask::CausalBottomRight, 128, 16}},
                           testing::Layout::BHSD, 41, kDesigns[0], "FLASHATTN_CUDA_FWD_CTAS", {nullptr, "0"}, 4,
                           6, &Problem::out, "of the walk differs from one CTA per block",
                           [](const ProblemConfig& c, DeviceProblem& d, const Options& o) {
                             return call("forward", c.describe(), [&] { d.forward(o); });
                           });
}

// ---- unaligned base pointers, odd strides ----------------------------------------------------
// Device copies whose 4-d tensors have padded strides: each head-dim row D + row_pad elements
// after the previous one (row_pad odd: rows start at every 2-byte alignment, never a multiple of
// 8 elements apart), extra gaps between heads and batches, and base pointers one element past
// a 16-byte boundary (lse: one float, stride padded too). The gaps hold a sentinel that no call
// may overwrite.
struct PaddedDeviceProblem {
  static constexpr unsigned char kSentinel = 0xa5;
  struct Buf {
    std::unique_ptr<DeviceBuffer> dev;
    std::vector<unsigned char> image;  // the device buffer as first uploaded
    std::vector<char> is_elem;         // per element slot of the image: 1 = a tensor element
    int64_t es = 0;
  };
  Problem& host;
  Buf bufs[9];
  Tensor q, k, v, dout, out, lse, dq, dk, dv;

  PaddedDeviceProblem(Problem& p, int64_t row_pad) : host(p) {
    Tensor* views[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
    const testing::HostTensor* hs[] = {&p.q,   &p.k,   &p.v,  &p.dout, &p.out,
                                       &p.lse, &p.dq,  &p.dk, &p.dv};
    const bool bshd = p.cfg.layout == testing::Layout::BSHD;
    for (int i = 0; i < 9; ++i) {
      const Tensor& hv = hs[i]->view;
      Tensor t = hv;
      if (t.ndim == 4) {
        const int64_t H = t.shape[1], S = t.shape[2], row = t.shape[3] + row_pad;
        t.stride[3] = 1;
        if (bshd) {
          t.stride[1] = row;
          t.stride[2] = H * row + 3;
          t.stride[0] = S * t.stride[2] + 5;
        } else {
          t.stride[2] = row;
          t.stride[1] = S * row + 3;
          t.stride[0] = H * t.stride[1] + 5;
        }
      } else {  // lse [B, H, Sq]
        t.stride[2] = 1;
        t.stride[1] = t.shape[2] + 3;
        t.stride[0] = t.shape[1] * t.stride[1] + 1;
      }
      Buf& b = bufs[i];
      b.es = dtype_size(t.dtype);
      int64_t span = 1;
      for (int x = 0; x < t.ndim; ++x) span += (t.shape[x] - 1) * t.stride[x];
      // The allocation is 256-byte aligned; 16 bytes of head room, then 1 element in.
      const int64_t first = 16 / b.es + 1, slots = first + span + 1;
      b.image.assign(static_cast<size_t>(slots * b.es), kSentinel);
      b.is_elem.assign(static_cast<size_t>(slots), 0);
      for_each(hv, t, [&](int64_t host_off, int64_t dev_off) {
        const int64_t slot = first + dev_off;
        b.is_elem[slot] = 1;
        unsigned char* dst = &b.image[slot * b.es];
        if (i < 4) std::memcpy(dst, &hs[i]->bytes[host_off * b.es], b.es);
        else std::memset(dst, 0xff, b.es);  // NaN
      });
      b.dev = std::make_unique<DeviceBuffer>(b.image.size());
      if (!b.dev->ptr) continue;
      cudaMemcpy(b.dev->ptr, b.image.data(), b.image.size(), cudaMemcpyHostToDevice);
      t.data = static_cast<char*>(b.dev->ptr) + first * b.es;
      t.device = 0;
      *views[i] = t;
    }
  }
  // f(host element offset, device element offset) for every logical index.
  template <class F>
  static void for_each(const Tensor& host_view, const Tensor& dev_view, F&& f) {
    int64_t n = 1;
    for (int x = 0; x < host_view.ndim; ++x) n *= host_view.shape[x];
    for (int64_t lin = 0; lin < n; ++lin) {
      int64_t r = lin, ho = 0, dof = 0;
      for (int x = host_view.ndim - 1; x >= 0; --x) {
        const int64_t idx = r % host_view.shape[x];
        r /= host_view.shape[x];
        ho += idx * host_view.stride[x];
        dof += idx * dev_view.stride[x];
      }
      f(ho, dof);
    }
  }
  bool ok() const {
    for (const Buf& b : bufs)
      if (!b.dev || !b.dev->ptr) return false;
    return true;
  }
  void forward(const Options& o) { flashattn::forward(q, k, v, out, lse, o); }
  void backward(const Options& o) { flashattn::backward(q, k, v, out, dout, lse, dq, dk, dv, o); }
  void poison_grads() { restore({6, 7, 8}); }
  void poison_outputs() { restore({4, 5}); }
  void restore(std::initializer_list<int> which) {
    for (int i : which)
      cudaMemcpy(bufs[i].dev->ptr, bufs[i].image.data(), bufs[i].image.size(),
                 cudaMemcpyHostToDevice);
  }
  std::vector<unsigned char> fetch(int i) {
    std::vector<unsigned char> img(bufs[i].image.size());
    cudaMemcpy(img.data(), bufs[i].dev->ptr, img.size(), cudaMemcpyDeviceToHost);
    return img;
  }
  // Copies the outputs' elements back into the host problem; counts overwritten gap bytes.
  int64_t gap_writes = 0;
  void download() {
    cudaDeviceSynchronize();
    const Tensor* dv_views[] = {&q, &k, &v, &dout, &out, &lse, &dq, &dk, &dv};
    testing::HostTensor* hs[] = {&host.q,   &host.k,  &host.v,  &host.dout, &host.out,
                                 &host.lse, &host.dq, &host.dk, &host.dv};
    for (int i = 4; i < 9; ++i) {
      const Buf& b = bufs[i];
      const std::vector<unsigned char> img = fetch(i);
      for (size_t s = 0; s < b.is_elem.size(); ++s)
        if (!b.is_elem[s])
          for (int64_t x = 0; x < b.es; ++x) gap_writes += img[s * b.es + x] != kSentinel;
      const int64_t first = (static_cast<const char*>(dv_views[i]->data) -
                             static_cast<const char*>(b.dev->ptr)) / b.es;
      for_each(hs[i]->view, *dv_views[i], [&](int64_t host_off, int64_t dev_off) {
        std::memcpy(&hs[i]->bytes[host_off * b.es], &img[(first + dev_off) * b.es], b.es);
      });
    }
  }
  bool inputs_unchanged() {
    cudaDeviceSynchronize();
    for (int i = 0; i < 4; ++i)
      if (fetch(i) != bufs[i].image) return false;
    return true;
  }
};

TEST(Cuda16Layout, UnalignedBasesAndOddRowStrides) {
  REQUIRE_GPU();
  using L = testing::Layout;
  const ProblemConfig cs[] = {
      make_config(2, 4, 2, 97, 130, 64, Mask::CausalBottomRight, DType::BFloat16, L::BSHD, 0, 41),
      make_config(1, 6, 1, 130, 97, 64, Mask::None, DType::Float16, L::BHSD, 0, 42),
      make_config(1, 4, 2, 70, 129, 111, Mask::CausalTopLeft, DType::Float16, L::BSHD, 0, 43),
      make_config(2, 2, 1, 129, 70, 128, Mask::CausalBottomRight, DType::BFloat16, L::BHSD, 0, 44),
  };
  for (const ProblemConfig& c : cs) {
    Problem p(c);
    const Expected e = expected_for(p);
    PaddedDeviceProblem d(p, /*row_pad=*/3);
    ASSERT_TRUE(d.ok());
    run_and_check(p, d, e, "padded strides, unaligned bases: ");
    EXPECT_EQ(0, d.gap_writes) << "bytes between tensor elements were overwritten\n"
                               << c.describe();
  }
}

// ---- streams ---------------------------------------------------------------------------------
// Every call must be queued on options.stream. The inputs reach the device only through a copy
// queued on that (non-blocking) stream behind a 200 ms host callback, and start as NaN: a kernel
// launched on any other stream runs during the callback, reads NaN and fails the check.
void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

TEST(Cuda16Stream, CallsAreQueuedOnTheOptionsStream) {
  REQUIRE_GPU();
  for (const DType dt : kDtypes16) {
    const ProblemConfig c = make_config(1, 4, 2, 200, 150, 64, Mask::CausalTopLeft, dt,
                                        testing::Layout::BSHD, 0, 51);
    Problem p(c);
    const Expected e = expected_for(p);
    DeviceProblem d(p);
    ASSERT_TRUE(d.ok());
    const Tensor* ins[] = {&d.q, &d.k, &d.v, &d.dout};
    const testing::HostTensor* hins[] = {&p.q, &p.k, &p.v, &p.dout};
    std::vector<void*> pinned(4, nullptr);
    for (int i = 0; i < 4; ++i) {
      CUDA_OK(cudaMallocHost(&pinned[i], hins[i]->bytes.size()));
      std::memcpy(pinned[i], hins[i]->bytes.data(), hins[i]->bytes.size());
    }
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (const Design& des : kDesigns) {
      for (int i = 0; i < 4; ++i) CUDA_OK(cudaMemset(ins[i]->data, 0xff, hins[i]->bytes.size()));
      d.poison();
      CUDA_OK(cudaDeviceSynchronize());
      EnvScope env("FLASHATTN_CUDA_BWD", des.env);
      EnvScope env_heads("FLASHATTN_CUDA_ORD_HEADS", des.ord_heads);
      EnvScope env_aheads("FLASHATTN_CUDA_ATOMIC_HEADS", des.atomic_heads);
      Options o = options16(c, des);
      o.stream = s;
      CUDA_OK(cudaLaunchHostFunc(s, hold_stream, nullptr));
      for (int i = 0; i < 4; ++i)
        CUDA_OK(cudaMemcpyAsync(ins[i]->data, pinned[i], hins[i]->bytes.size(),
                                cudaMemcpyHostToDevice, s));
      const std::string info = std::string(des.name) + " on a user stream: " + c.describe();
      const bool ran = call("forward", info, [&] { d.forward(o); }) &&
                       call("backward", info, [&] { d.backward(o); });
      CUDA_OK(cudaStreamSynchronize(s));
      if (!ran) continue;
      p.poison_outputs();
      d.download();
      std::vector<double> got[5];
      got[0] = p.to_double(p.out);
      got[1] = p.to_double(p.lse);
      got[2] = p.to_double(p.dq);
      got[3] = p.to_double(p.dk);
      got[4] = p.to_double(p.dv);
      Report rep;
      check_tensors(c, e, got, 0, 4, des.name, info, rep);
    }
    CUDA_OK(cudaStreamDestroy(s));
    for (void* x : pinned) cudaFreeHost(x);
  }
}

// ---- the backward design override ------------------------------------------------------------
// FLASHATTN_CUDA_BWD (a developer override): a value other than split / atomic / ordered is an error rather
// than a silent default (the atomic checks above would otherwise test the default design).
TEST(Cuda16BadInput, UnknownBackwardDesign) {
  REQUIRE_GPU();
  const ProblemConfig c = make_config(1, 2, 1, 8, 8, 64, Mask::None, DType::BFloat16);
  Problem p(c);
  DeviceProblem d(p);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(call("forward", c.describe(), [&] { d.forward(options_for(c)); }));
  // Refused when set, naming the knob and the value; the library keeps its choice and works on.
  EXPECT_EQ(flashattn_dev_set_override("FLASHATTN_CUDA_BWD", "atomics"), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("FLASHATTN_CUDA_BWD"), std::string::npos) << flashattn_last_error();
  EXPECT_NE(std::string(flashattn_last_error()).find("atomics"), std::string::npos) << flashattn_last_error();
  EXPECT_TRUE(call("backward", c.describe(), [&] { d.backward(options_for(c)); }));
}


// ---- caller-owned workspace (options.workspace / workspace_query) ----------------------------

// The query gives the plan's scratch (the deterministic backward's D rows at least) and writes
// nothing; a call given that much of the caller's memory allocates none of its own and returns
// the pool's results bit for bit; a smaller, misaligned, host or overlapping workspace is refused
// before anything is written.
TEST(Cuda16Workspace, QueryThenCallerMemory) {
  REQUIRE_GPU();
  const ProblemConfig c = make_config(2, 4, 2, 300, 300, 128, Mask::CausalBottomRight, DType::BFloat16,
                                      testing::Layout::BSHD, 0, 55);
  Problem p(c);
  DeviceProblem d(p);
  ASSERT_TRUE(d.ok());
  Options o = options16(c, kDesigns[0]);
  o.deterministic = true;
  d.forward(o);
  d.backward(o);
  p.poison_outputs();
  d.download();
  const Snapshot pool = snapshot(p);

  uint64_t need = 0;
  Options q = o;
  q.workspace_query = &need;
  d.poison_grads();
  ASSERT_NO_THROW(d.backward(q));
  EXPECT_GE(need, static_cast<uint64_t>(2 * 4 * 300 * 4)) << "D: one float per query row";
  p.poison_outputs();
  d.download();
  for (const testing::HostTensor* t : {&p.dq, &p.dk, &p.dv}) {
    const std::vector<double> x = p.to_double(*t);
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double y) { return std::isnan(y); })) << "a query wrote gradients";
  }

  DeviceBuffer ws(need + 512);
  ASSERT_NE(ws.ptr, nullptr);
  Options w = o;
  w.workspace = ws.ptr;
  w.workspace_bytes = need;
  d.poison_grads();
  ASSERT_NO_THROW(d.backward(w));
  p.poison_outputs();
  d.download();
  EXPECT_TRUE(snapshot(p) == pool) << "the caller's workspace changed the results";

  auto refused = [&](Options bad, const char* needle) {
    d.poison_grads();
    EXPECT_TRUE(throws_error([&] { d.backward(bad); }, Status::InvalidArgument, {needle})) << needle;
    p.poison_outputs();
    d.download();
    const std::vector<double> x = p.to_double(p.dq);
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double y) { return std::isnan(y); })) << needle << ": written";
  };
  Options small = w;
  small.workspace_bytes = need - 4;
  refused(small, "options.workspace_bytes");
  Options misaligned = w;
  misaligned.workspace = static_cast<char*>(ws.ptr) + 16;
  refused(misaligned, "aligned to 256");
  std::vector<unsigned char> host(need + 512);
  Options on_host = w;
  on_host.workspace = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(host.data()) + 255) / 256 * 256);
  refused(on_host, "host memory");
  Options overlap = w;
  overlap.workspace = d.dq.data;  // (cudaMalloc'd: 256-byte aligned)
  refused(overlap, "overlaps");
}

// KV-cache and packed calls query too (the KV-cache split partials, the packed maps).
TEST(Cuda16Workspace, KvcacheQuery) {
  REQUIRE_GPU();
  const int64_t B = 1, S = 8192, Hq = 32, Hkv = 8, D = 128;
  DeviceBuffer q(B * Hq * D * 2), kc(B * S * Hkv * D * 2), vc(B * S * Hkv * D * 2), out(B * Hq * D * 2), lse(B * Hq * 4);
  ASSERT_TRUE(q.ptr && kc.ptr && vc.ptr && out.ptr && lse.ptr);
  const Tensor tq = Tensor::bshd(q.ptr, DType::BFloat16, B, Hq, 1, D, 0);
  const Tensor tk = Tensor::bshd(kc.ptr, DType::BFloat16, B, Hkv, S, D, 0);
  const Tensor tv = Tensor::bshd(vc.ptr, DType::BFloat16, B, Hkv, S, D, 0);
  const Tensor to = Tensor::bshd(out.ptr, DType::BFloat16, B, Hq, 1, D, 0);
  const Tensor tl = Tensor::lse(static_cast<float*>(lse.ptr), B, Hq, 1, 0);
  // (bshd views are [B, H, S, D] logically; the KV-cache call takes [B, S, H, D] tensors.)
  auto as_bshd = [](Tensor t) {
    std::swap(t.shape[1], t.shape[2]);
    std::swap(t.stride[1], t.stride[2]);
    return t;
  };
  uint64_t need = 0;
  Options o;
  o.workspace_query = &need;
  KvCache kv;
  ASSERT_NO_THROW(forward_kvcache(as_bshd(tq), as_bshd(tk), as_bshd(tv), as_bshd(to), tl, kv, o));
  EXPECT_GT(need, static_cast<uint64_t>(Hq * D * 4)) << "split partials";
  kv.num_splits = 1;
  uint64_t one = 0;
  o.workspace_query = &one;
  ASSERT_NO_THROW(forward_kvcache(as_bshd(tq), as_bshd(tk), as_bshd(tv), as_bshd(to), tl, kv, o));
  EXPECT_LT(one, need) << "no partials without splits";
}

}  // namespace
}  // namespace flashattn::test
