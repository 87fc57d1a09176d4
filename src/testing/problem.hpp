// One problem generator and one FLOP formula, shared by the tests, the benchmarks and the CLI.
//
// A Problem owns host buffers for every tensor of a forward + backward call, stored in the chosen
// dtype and memory layout, with inputs drawn from N(0, 1) by a seeded generator (never zeros: they
// hide unwritten outputs), and outputs poisoned with NaN so a missed element cannot pass.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/reference.hpp"

namespace flashattn::testing {

enum class Layout { BHSD, BSHD };  // memory order of q/k/v/out/dout/dq/dk/dv

// ALiBi slopes of a problem: none, one [Hq] vector shared by the batch, or a [B, Hq] matrix.
enum class AlibiKind { None, Heads, BatchHeads };

struct ProblemConfig {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, seq_q = 1, seq_kv = 1, head_dim = 64;
  Mask mask = Mask::None;
  DType dtype = DType::Float32;
  Layout layout = Layout::BHSD;
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(D)
  uint64_t seed = 0;
  // Score modifications (flashattn.h): a sliding window (-1 = unbounded side), a logit softcap
  // (0 = none) and ALiBi slopes (Problem::alibi holds them; standard_alibi_slopes by default).
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  AlibiKind alibi = AlibiKind::None;
  std::string describe() const;  // the modifications only when set
  float scale() const;  // resolved
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
};

// A problem in one line, as tests, benchmarks and the CLI spell their shapes.
ProblemConfig make_config(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q,
                          int64_t seq_kv, int64_t head_dim, Mask mask = Mask::None,
                          DType dtype = DType::Float32, Layout layout = Layout::BHSD,
                          float softmax_scale = 0.0f, uint64_t seed = 0);

// FLOPs counted the usual way: forward 4*B*H*Sq*Skv*D (two matmuls), halved when causal
// (an approximation for Sq != Skv, as every peer reports it); backward 2.5x the forward. With a
// sliding window, 4*B*H*D times the exact number of visible (query, key) pairs instead (a window
// makes the dense count meaningless). Softcap and ALiBi add no FLOPs to the model.
double forward_flops(const ProblemConfig& c);
double backward_flops(const ProblemConfig& c);

const char* layout_name(Layout l);
const char* alibi_name(AlibiKind a);  // "none", "[Hq]", "[B,Hq]"

// The ALiBi paper's slopes for H heads: 2^(-8 (h + 1) / H) for head h.
std::vector<float> standard_alibi_slopes(int64_t heads);

// A host buffer and its view.
struct HostTensor {
  std::vector<unsigned char> bytes;
  Tensor view;
  int64_t numel() const;
};

struct Problem {
  explicit Problem(const ProblemConfig& cfg);
  ProblemConfig cfg;
  HostTensor q, k, v, dout;         // inputs, random
  HostTensor out, lse, dq, dk, dv;  // outputs, poisoned with NaN
  // ALiBi slopes, float32 [Hq] or [B, Hq] (cfg.alibi; empty with ndim 0 when none): the standard
  // slopes of Hq heads, batch b's scaled by 1 + b / 2 so that rows of [B, Hq] differ. Tests may
  // overwrite them (zero and negative slopes are legal).
  HostTensor alibi;

  // The library's options for this problem (mask, scale, window, softcap, the slopes' view);
  // the Options point at this->alibi.view.
  Options options(int32_t num_threads = 0) const;
  // The float64 reference's view of the modifications (slopes per b * Hq + h).
  RefMods ref_mods() const;

  void poison_outputs();
  // Logical [B,H,S,D] (or [B,H,Sq] for lse) contiguous copy in double.
  std::vector<double> to_double(const HostTensor& t) const;
};

// A view with the same shape/strides/dtype as `like` over other memory (e.g. a device copy).
Tensor rebind(const Tensor& like, void* data, int32_t device);

// Read/write one element of any dtype as double.
double load_element(const void* base, DType dtype, int64_t offset);
void store_element(void* base, DType dtype, int64_t offset, double value);

// Errors of `got` against `ref` (same length). -inf matches -inf; any NaN is counted.
struct ErrorStats {
  double max_abs = 0;   // max |got - ref|
  double max_ref = 0;   // max |ref|
  double rel = 0;       // max_abs / max(max_ref, tiny)
  int64_t nan = 0;      // NaN (or unexpected inf) elements in got
  int64_t count = 0;
  std::string str() const;
};
ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref);

}  // namespace flashattn::testing
