// `flashattn check`: one random problem through forward and backward, every output compared with
// the float64 reference computed on the same (rounded) inputs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>
#include <thread>

#include "commands.hpp"
#include "common.hpp"
#include "device.hpp"
#include "testing/naive.hpp"
#include "testing/reference.hpp"

namespace flashattn::cli {
namespace {

// Allowed max|got - ref| / max|ref| per output. The reference sees the inputs already rounded to
// the dtype, so what remains is the kernel's own arithmetic plus rounding the outputs to the
// dtype (2^-9 relative for bfloat16, 2^-12 for float16) and, on tensor cores, rounding P and dS to
// the dtype before the second matmul of each pair. float32 keeps two orders of magnitude over
// the ~1e-6 a float32 accumulation over a few thousand terms shows; tf32 has a 10-bit mantissa.
// Seen on the CPU backend (S 1024 x 777, D 96, GQA): float16 <= 4.3e-4, bfloat16 <= 3.1e-3, so
// float16 and bfloat16 keep about 10x for the extra roundings of tensor-core kernels.
// float64: lse is stored as float32 by contract (rel. error 2^-24); the CPU backend's float64
// backward recomputes the row LSE in double, so out, dq, dk and dv are held to float64 accuracy.
double default_tolerance(DType dtype, Precision precision, bool on_cuda, const std::string& output) {
  switch (dtype) {
    case DType::Float64: return output == "lse" ? 1e-6 : 1e-10;
    case DType::Float32: return on_cuda && precision == Precision::Tf32 ? 1e-2 : 1e-4;
    case DType::Float16: return 5e-3;
    case DType::BFloat16: return 3e-2;
  }
  return 0;
}

struct CheckOptions {
  RunOptions run;
  bool naive = false;  // check the naive baseline instead of the library
  double tol = 0;      // 0 = default_tolerance()
};

struct Outputs {
  std::vector<double> out, lse, dq, dk, dv;
};

// The float64 reference, one task per (batch, query head) so that every thread has work even with
// one kv head. dK/dV of a kv head are then summed over its query heads in head order, the order
// reference_backward itself uses, so the result equals one big call bit for bit.
Outputs reference(const testing::Problem& p, int threads) {
  const testing::ProblemConfig& c = p.cfg;
  const std::vector<double> q = p.to_double(p.q), k = p.to_double(p.k), v = p.to_double(p.v),
                            dout = p.to_double(p.dout);
  const int64_t Sq = c.seq_q, Skv = c.seq_kv, D = c.head_dim, group = c.heads_q / c.heads_kv;
  const int64_t heads = c.batch * c.heads_q;
  const double scale = static_cast<double>(c.scale());
  const testing::RefMods all_mods = p.ref_mods();  // slopes per b * Hq + h, the task index
  Outputs r;
  r.out.resize(q.size());
  r.lse.resize(static_cast<size_t>(heads * Sq));
  r.dq.resize(q.size());
  std::vector<double> dk_h(static_cast<size_t>(heads * Skv * D)), dv_h(dk_h.size());

  Progress::global().stage("reference (float64)", heads);
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    const testing::RefShape one{1, 1, 1, Sq, Skv, D};
    for (int64_t h = next++; h < heads; h = next++) {
      const int64_t kvh = (h / c.heads_q) * c.heads_kv + (h % c.heads_q) / group;
      auto slice = [](const std::vector<double>& x, int64_t at, int64_t n) {
        return std::vector<double>(x.begin() + at * n, x.begin() + (at + 1) * n);
      };
      const auto qh = slice(q, h, Sq * D), kh = slice(k, kvh, Skv * D), vh = slice(v, kvh, Skv * D),
                 doh = slice(dout, h, Sq * D);
      // The problem's modifications, with the slope of this (batch, head) as the only one.
      testing::RefMods mods = all_mods;
      if (!all_mods.alibi.empty()) mods.alibi.assign(1, all_mods.alibi[static_cast<size_t>(h)]);
      const testing::RefForward f = testing::reference_forward(one, qh, kh, vh, scale, c.mask, mods);
      const testing::RefBackward b =
          testing::reference_backward(one, qh, kh, vh, doh, scale, c.mask, mods);
      std::copy(f.out.begin(), f.out.end(), r.out.begin() + h * Sq * D);
      std::copy(f.lse.begin(), f.lse.end(), r.lse.begin() + h * Sq);
      std::copy(b.dq.begin(), b.dq.end(), r.dq.begin() + h * Sq * D);
      std::copy(b.dk.begin(), b.dk.end(), dk_h.begin() + h * Skv * D);
      std::copy(b.dv.begin(), b.dv.end(), dv_h.begin() + h * Skv * D);
      Progress::global().advance();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < std::min<int64_t>(threads, heads); ++i) {
    try {
      pool.emplace_back(worker);
    } catch (const std::exception&) {
      break;  // the system refuses more threads (pid or memory limit): the rest do the work
    }
  }
  worker();
  for (auto& t : pool) t.join();

  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = (h / c.heads_q) * c.heads_kv + (h % c.heads_q) / group;
    for (int64_t i = 0; i < Skv * D; ++i) {
      r.dk[kvh * Skv * D + i] += dk_h[h * Skv * D + i];
      r.dv[kvh * Skv * D + i] += dv_h[h * Skv * D + i];
    }
  }
  return r;
}

// The library on the chosen device. Returns {forward ms, backward ms} of the single calls.
std::pair<double, double> run_library(testing::Problem& p, const RunOptions& run) {
  DeviceProblem dp(p, run.device);
  const Options o = run.library_options(dp.stream(), &dp.alibi);
  Timer timer(dp.device(), dp.stream());
  Progress::global().stage("forward");
  timer.start();
  try {
    forward(dp.q, dp.k, dp.v, dp.out, dp.lse, o);
  } catch (const Error& e) {
    throw Error(e.status(), std::string("forward: ") + e.what());
  }
  const double fwd = timer.stop_ms();
  Progress::global().stage("backward");
  timer.start();
  try {
    backward(dp.q, dp.k, dp.v, dp.out, dp.dout, dp.lse, dp.dq, dp.dk, dp.dv, o);
  } catch (const Error& e) {
    throw Error(e.status(), std::string("backward: ") + e.what());
  }
  const double bwd = timer.stop_ms();
  dp.download_outputs();
  return {fwd, bwd};
}

// The naive float32 baseline (CPU), its outputs stored back into the problem in its dtype.
std::pair<double, double> run_naive(testing::Problem& p, const RunOptions& run) {
  const testing::ProblemConfig& c = p.cfg;
  const testing::NaiveShape s{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, c.head_dim};
  const std::vector<float> q = to_float(p.q), k = to_float(p.k), v = to_float(p.v),
                           dout = to_float(p.dout);
  std::vector<float> out(q.size()), lse(static_cast<size_t>(c.batch * c.heads_q * c.seq_q)),
      dq(q.size()), dk(k.size()), dv(v.size());
  testing::NaiveSaved saved;
  Progress::global().stage("naive forward");
  double t = now_seconds();
  testing::naive_forward(s, q.data(), k.data(), v.data(), c.scale(), c.mask, out.data(), lse.data(),
                         saved, run.threads);
  const double fwd = (now_seconds() - t) * 1e3;
  Progress::global().stage("naive backward");
  t = now_seconds();
  testing::naive_backward(s, q.data(), k.data(), v.data(), dout.data(), saved, c.scale(), dq.data(),
                          dk.data(), dv.data(), run.threads);
  const double bwd = (now_seconds() - t) * 1e3;
  store_logical(p.out, out.data());
  store_logical(p.lse, lse.data());
  store_logical(p.dq, dq.data());
  store_logical(p.dk, dk.data());
  store_logical(p.dv, dv.data());
  return {fwd, bwd};
}

// Shortest scientific form that reads back as the same double ("1e-04", "2.5e-03").
std::string sci_short(double v) {
  for (int p = 0; p < 16; ++p) {
    const std::string s = sci(v, p);
    if (std::stod(s) == v) return s;
  }
  return sci(v, 16);
}

std::string tolerance_help() {
  auto t = [](DType d, Precision p = Precision::Fp32, const char* out = "dq") {
    return sci_short(default_tolerance(d, p, true, out));
  };
  std::ostringstream os;
  os << "tolerances: rel err = max |got - ref| / max |ref| per output; any NaN or unwritten\n"
     << "element fails:\n"
     << "  float64   " << t(DType::Float64) << " (lse " << t(DType::Float64, Precision::Fp32, "lse")
     << ": it is float32 by contract)\n"
     << "  float32   " << t(DType::Float32) << " (tf32 on CUDA: " << t(DType::Float32, Precision::Tf32)
     << ")\n"
     << "  float16   " << t(DType::Float16) << "\n"
     << "  bfloat16  " << t(DType::BFloat16) << "\n";
  return os.str();
}

}  // namespace

int run_check(int argc, char** argv, int first) {
  CheckOptions opt;
  testing::ProblemConfig& c = opt.run.problem;
  // Default shape: small enough that the float64 reference takes seconds on two cores.
  c.batch = 1;
  c.heads_q = 8;
  c.seq_q = 1024;
  c.head_dim = 64;

  ArgParser parser("flashattn check",
                   "flashattn check: run forward and backward on a random problem (inputs from\n"
                   "N(0,1), outputs pre-filled with NaN) and compare out, lse, dq, dk and dv with a\n"
                   "float64 reference computed on the same inputs (after rounding to --dtype).\n"
                   "Default problem: B=1 Hq=Hkv=8 S=1024 D=64, float32, no mask.");
  opt.run.add_flags(parser);
  parser.section("check");
  parser.flag("--impl", "I",
              "flashattn | naive: check the library (default) or the naive float32\n"
              "O(S^2)-memory baseline that `bench` compares against (CPU only)",
              [&](const std::string& t) {
                opt.naive = parse_choice("--impl", t, {"flashattn", "naive"}) == 1;
              });
  parser.flag("--tol", "X", "override the relative tolerance of every output (default: per dtype)",
              [&](const std::string& t) {
                opt.tol = parse_double("--tol", t);
                if (opt.tol <= 0) throw UsageError("--tol: must be > 0, got '" + t + "'");
              });
  parser.epilogue(tolerance_help() +
                  "\nexit status: 0 pass, 1 an output is NaN, unwritten or beyond tolerance,\n"
                  "2 bad command line, 3 library or CUDA error, 4 not supported by this build.\n"
                  "\nexamples:\n"
                  "  flashattn check --seq 1024 --heads 8 --head-dim 128 --mask causal\n"
                  "  flashattn check --dtype bfloat16 --layout bshd --seq-q 100 --seq-kv 37 \\\n"
                  "                  --mask causal_bottom_right\n");
  if (!parser.parse(argc, argv, first)) return kExitOk;
  opt.run.finish();
  if (opt.naive && opt.run.device >= 0)
    throw UsageError("--impl naive runs on the CPU only (use --device cpu)");
  if (opt.naive && opt.run.has_score_mods())
    throw UsageError("--impl naive has no sliding window, softcap or ALiBi (drop --window, --softcap "
                     "and --alibi, or check the library)");

  const bool on_cuda = opt.run.device >= 0;
  auto tolerance = [&](const std::string& output) {
    if (opt.tol > 0) return opt.tol;
    const double t = default_tolerance(c.dtype, opt.run.precision, on_cuda, output);
    // The naive baseline computes in float32 whatever the dtype: float64 gets float32's bar.
    return opt.naive ? std::max(t, default_tolerance(DType::Float32, Precision::Fp32, false, output))
                     : t;
  };

  emit("flashattn check: " + c.describe() + "\n" + opt.run.describe_exec() + ", implementation " +
       (opt.naive ? "naive (float32, O(S^2) memory)" : std::string("flashattn ") + flashattn_version()) +
       "\n");
  const std::unique_ptr<testing::Problem> problem = make_problem(c);
  testing::Problem& p = *problem;
  const std::pair<double, double> ms = opt.naive ? run_naive(p, opt.run) : run_library(p, opt.run);
  emit("forward " + fmt(ms.first, 2) + " ms, backward " + fmt(ms.second, 2) +
       " ms (single cold calls; `flashattn bench` measures properly)\n");

  const int threads = opt.run.resolved_threads();
  const double t0 = now_seconds();
  const Outputs ref = reference(p, threads);
  emit("reference: float64, " + std::to_string(threads) + " threads, " +
       fmt(now_seconds() - t0, 1) + " s\n\n");
  Progress::global().finish();

  struct Row {
    const char* name;
    testing::ErrorStats e;
  };
  const Row rows[] = {{"out", testing::compare(p.to_double(p.out), ref.out)},
                      {"lse", testing::compare(p.to_double(p.lse), ref.lse)},
                      {"dq", testing::compare(p.to_double(p.dq), ref.dq)},
                      {"dk", testing::compare(p.to_double(p.dk), ref.dk)},
                      {"dv", testing::compare(p.to_double(p.dv), ref.dv)}};
  std::ostringstream os;
  os << pad("output", 8) << rpad("elements", 10) << rpad("max abs err", 13) << rpad("max |ref|", 11)
     << rpad("rel err", 11) << rpad("tolerance", 11) << rpad("NaN", 7) << "  result\n";
  std::vector<std::string> failures;
  for (const Row& r : rows) {
    const double tol = tolerance(r.name);
    const bool ok = r.e.nan == 0 && r.e.rel <= tol;
    os << pad(r.name, 8) << rpad(std::to_string(r.e.count), 10) << rpad(sci(r.e.max_abs), 13)
       << rpad(fmt(r.e.max_ref, 3), 11) << rpad(sci(r.e.rel), 11) << rpad(sci_short(tol), 11)
       << rpad(std::to_string(r.e.nan), 7) << "  " << (ok ? "ok" : "FAIL") << "\n";
    if (r.e.nan > 0)
      failures.push_back(std::string(r.name) + ": " + std::to_string(r.e.nan) +
                         " NaN/inf or unwritten elements");
    else if (!ok)
      failures.push_back(std::string(r.name) + ": rel err " + sci(r.e.rel) + " > " + sci_short(tol));
  }
  os << "\ntolerance for " << dtype_name(c.dtype);
  if (c.dtype == DType::Float32 && on_cuda) os << " (" << precision_name(opt.run.precision) << ")";
  if (opt.tol > 0)
    os << " (from --tol)";
  else if (opt.naive)
    os << " (naive baseline: at least float32's)";
  os << ": rel err = max abs err / max |ref| must be <= tolerance; NaN fails\n";
  if (failures.empty()) {
    os << "PASS\n";
  } else {
    os << "FAIL:";
    for (const std::string& f : failures) os << " " << f << ";";
    os << "\n";
  }
  emit(os.str());
  return failures.empty() ? kExitOk : kExitCheckFailed;
}

}  // namespace flashattn::cli
