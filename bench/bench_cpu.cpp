// CPU benchmark: median time and GFLOP/s of forward, backward and forward+backward, next to a
// large float32 GEMM (OpenBLAS cblas_sgemm) measured in the same run on the same threads.
//
//   flashattn-bench-cpu [--batch 1] [--heads 8] [--heads-kv H] [--seq 2048] [--seq-kv S]
//                       [--dim 128] [--mask none,causal] [--dtype float32] [--layout bhsd]
//                       [--threads 0] [--reps 5] [--gemm 4096]
//
// FLOPs: testing::forward_flops / backward_flops (src/testing/problem.cpp, the one FLOP model;
// docs/PERF.md states it); inputs come from testing::Problem.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"

#if defined(FLASHATTN_BENCH_OPENBLAS)
#include <cblas.h>
#endif

using namespace flashattn;
using flashattn::testing::Layout;
using flashattn::testing::Problem;
using flashattn::testing::ProblemConfig;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void usage(const char* msg) {
  if (msg) std::fprintf(stderr, "error: %s\n\n", msg);
  std::fprintf(stderr,
               "usage: flashattn-bench-cpu [options]\n"
               "  --batch N       batch size (1)\n"
               "  --heads N       query heads (8)\n"
               "  --heads-kv N    key/value heads (= heads)\n"
               "  --seq N         query length (2048)\n"
               "  --seq-kv N      key/value length (= seq)\n"
               "  --dim N         head dim (128)\n"
               "  --mask LIST     comma-separated: none, causal (top-left), causal_br (none,causal)\n"
               "  --dtype T       float32, float16, bfloat16, float64 (float32)\n"
               "  --layout L      bhsd or bshd (bhsd)\n"
               "  --threads N     CPU threads, 0 = all hardware threads (0)\n"
               "  --reps N        repetitions; each runs sgemm, forward, backward, fwd+bwd once (5)\n"
               "  --gemm N        size of the square sgemm reference, 0 = skip (4096)\n");
  std::exit(msg ? 2 : 0);
}

}  // namespace

int main(int argc, char** argv) {
  // heads_kv and seq_kv 0: "same as the query side" unless a flag sets them.
  ProblemConfig base = testing::make_config(1, 8, 0, 2048, 0, 128);
  std::string masks = "none,causal";
  int threads = 0, reps = 5, gemm_n = 4096;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") usage(nullptr);
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    std::string v = argv[++i];
    auto num = [&] {
      char* end = nullptr;
      long long x = std::strtoll(v.c_str(), &end, 10);
      if (!end || *end || x < 0) usage((a + ": not a non-negative integer: " + v).c_str());
      return static_cast<int64_t>(x);
    };
    if (a == "--batch") base.batch = num();
    else if (a == "--heads") base.heads_q = num();
    else if (a == "--heads-kv") base.heads_kv = num();
    else if (a == "--seq") base.seq_q = num();
    else if (a == "--seq-kv") base.seq_kv = num();
    else if (a == "--dim") base.head_dim = num();
    else if (a == "--mask") masks = v;
    else if (a == "--threads") threads = static_cast<int>(num());
    else if (a == "--reps") reps = std::max(1, static_cast<int>(num()));
    else if (a == "--gemm") gemm_n = static_cast<int>(num());
    else if (a == "--layout") {
      if (v == "bhsd") base.layout = Layout::BHSD;
      else if (v == "bshd") base.layout = Layout::BSHD;
      else usage(("unknown layout " + v).c_str());
    } else if (a == "--dtype") {
      if (v == "float32") base.dtype = DType::Float32;
      else if (v == "float16") base.dtype = DType::Float16;
      else if (v == "bfloat16") base.dtype = DType::BFloat16;
      else if (v == "float64") base.dtype = DType::Float64;
      else usage(("unknown dtype " + v).c_str());
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (base.heads_kv == 0) base.heads_kv = base.heads_q;
  if (base.seq_kv == 0) base.seq_kv = base.seq_q;
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  std::printf("%s", build_info().c_str());
  std::printf("threads %d, reps %d (median)\n", threads, reps);

  // ---- the GEMM yardstick ----
  // The sgemm runs interleaved with the attention passes (one of each per repetition), so on a
  // shared machine both see the same interference; "vs sgemm" is the median over repetitions of
  // the ratio within one repetition.
  std::function<void()> gemm;
  double gemm_flops = 0;
#if defined(FLASHATTN_BENCH_OPENBLAS)
  std::vector<float> A, B, C;
  if (gemm_n > 0) {
    openblas_set_num_threads(threads);
    const char* ct = std::getenv("OPENBLAS_CORETYPE");
    const size_t n = static_cast<size_t>(gemm_n);
    A.resize(n * n);
    B.resize(n * n);
    C.resize(n * n);
    for (size_t i = 0; i < n * n; ++i) {
      A[i] = static_cast<float>((i * 7919) % 1000) * 1e-3f - 0.5f;
      B[i] = static_cast<float>((i * 104729) % 1000) * 1e-3f - 0.5f;
    }
    gemm = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, gemm_n, gemm_n, gemm_n, 1.0f,
                  A.data(), gemm_n, B.data(), gemm_n, 0.0f, C.data(), gemm_n);
    };
    gemm_flops = 2.0 * n * n * n;
    std::printf("sgemm %dx%dx%d row-major (%s, OPENBLAS_CORETYPE=%s, %d threads)\n", gemm_n,
                gemm_n, gemm_n, openblas_get_config(), ct ? ct : "(unset)", threads);
  }
#else
  (void)gemm_n;
  std::printf("sgemm comparison skipped: built without OpenBLAS (install libopenblas-dev)\n");
#endif

  std::printf("\n%-8s %-9s %10s %10s %9s %10s\n", "mask", "pass", "median ms", "GFLOP/s",
              "vs sgemm", "fastest ms");
  std::stringstream ms(masks);
  std::string mname;
  int bad = 0;
  while (std::getline(ms, mname, ',')) {
    ProblemConfig c = base;
    if (mname == "none") c.mask = Mask::None;
    else if (mname == "causal") c.mask = Mask::CausalTopLeft;
    else if (mname == "causal_br") c.mask = Mask::CausalBottomRight;
    else usage(("unknown mask " + mname).c_str());
    Problem p(c);
    Options o;
    o.mask = c.mask;
    o.num_threads = threads;
    auto fwd = [&] { forward(p.q.view, p.k.view, p.v.view, p.out.view, p.lse.view, o); };
    auto bwd = [&] {
      backward(p.q.view, p.k.view, p.v.view, p.out.view, p.dout.view, p.lse.view, p.dq.view,
               p.dk.view, p.dv.view, o);
    };
    auto both = [&] {
      fwd();
      bwd();
    };
    const double ff = testing::forward_flops(c), fb = testing::backward_flops(c);
    struct Pass {
      const char* name;
      std::function<void()> fn;
      double flops;
      std::vector<double> t;
    };
    Pass passes[] = {{"forward", fwd, ff, {}}, {"backward", bwd, fb, {}}, {"fwd+bwd", both, ff + fb, {}}};
    std::vector<double> tg;
    if (gemm) gemm();  // warm-up
    both();
    for (int r = 0; r < reps; ++r) {
      if (gemm) {
        double t0 = now_s();
        gemm();
        tg.push_back(now_s() - t0);
        // OpenBLAS's worker threads spin for a while (about 2^28 cycles) after a call before they
        // sleep; timing the next pass during that window would measure it on one core.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      }
      for (Pass& ps : passes) {
        double t0 = now_s();
        ps.fn();
        ps.t.push_back(now_s() - t0);
      }
    }
    // A benchmark of garbage is worthless: every output must be finite.
    for (auto* t : {&p.out, &p.dq, &p.dk, &p.dv}) {
      auto d = p.to_double(*t);
      for (double x : d)
        if (!std::isfinite(x)) {
          ++bad;
          break;
        }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("# %s\n", c.describe().c_str());
    if (gemm)
      std::printf("%-8s %-9s %10.2f %10.1f %9s %10.2f\n", mname.c_str(), "sgemm", median(tg) * 1e3,
                  gemm_flops / median(tg) * 1e-9, "100%",
                  *std::min_element(tg.begin(), tg.end()) * 1e3);
    for (Pass& ps : passes) {
      char rel[32] = "-";
      if (gemm) {
        std::vector<double> ratio;
        for (int r = 0; r < reps; ++r) ratio.push_back((ps.flops / ps.t[r]) / (gemm_flops / tg[r]));
        std::snprintf(rel, sizeof rel, "%.1f%%", 100.0 * median(ratio));
      }
      const double tm = median(ps.t);
      std::printf("%-8s %-9s %10.2f %10.1f %9s %10.2f\n", mname.c_str(), ps.name, tm * 1e3,
                  ps.flops / tm * 1e-9, rel, *std::min_element(ps.t.begin(), ps.t.end()) * 1e3);
    }
  }
  if (bad) {
    std::fprintf(stderr, "error: %d outputs contained non-finite values\n", bad);
    return 1;
  }
  return 0;
}
