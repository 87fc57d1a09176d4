// `flashattn bench`: median time and throughput of forward, backward and both; peak extra memory;
// the naive O(S^2)-memory baseline next to it on the CPU.
#include <functional>
#include <sstream>

#include "commands.hpp"
#include "common.hpp"
#include "device.hpp"
#include "memory.hpp"
#include "testing/naive.hpp"

namespace flashattn::cli {
namespace {

struct BenchOptions {
  RunOptions run;
  int reps = 5;
  int warmup = 1;
  bool naive = true;
  double naive_cap_gib = 4.0;
};

struct Result {
  double fwd_ms = 0, bwd_ms = 0, both_ms = 0;
  int64_t heap_extra = -1, rss_extra = -1;  // -1: not measured
};

// Warm-up, then `reps` timed calls of forward, of backward and of forward+backward, each timed on
// its own; medians. Forward reps run first so the backward always sees a valid out and lse.
// Memory is measured over the timed calls only (after warm-up has made any one-time allocations).
// `release` runs between warm-up and measurement to drop what the warm-up left alive (the naive
// forward's saved P), so that the peak includes it.
Result time_passes(const std::string& name, const std::function<void()>& fwd,
                   const std::function<void()>& bwd, Timer& timer, const BenchOptions& o,
                   bool measure_memory, const std::function<void()>& release = {}) {
  Progress& progress = Progress::global();
  progress.stage(name + " warm-up", o.warmup);
  for (int i = 0; i < o.warmup; ++i) {
    fwd();
    bwd();
    progress.advance();
  }
  // Everything the loop itself needs is allocated before the meter starts, so the heap figure is
  // the implementation's alone.
  const std::string labels[3] = {name + " forward", name + " backward", name + " forward+backward"};
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(o.reps));
  if (release) release();
  MemoryMeter meter;
  if (measure_memory) meter.start();
  auto run = [&](int pass, bool f, bool b) {
    progress.stage(labels[pass], o.reps);
    ms.clear();
    for (int i = 0; i < o.reps; ++i) {
      timer.start();
      if (f) fwd();
      if (b) bwd();
      ms.push_back(timer.stop_ms());
      progress.advance();
    }
    return median(ms);
  };
  Result r;
  r.fwd_ms = run(0, true, false);
  r.bwd_ms = run(1, false, true);
  r.both_ms = run(2, true, true);
  if (measure_memory) {
    r.heap_extra = meter.heap_extra();
    r.rss_extra = meter.rss_extra();
  }
  return r;
}

}  // namespace

int run_bench(int argc, char** argv, int first) {
  BenchOptions opt;
  testing::ProblemConfig& c = opt.run.problem;
  c.batch = 1;
  c.heads_q = 8;
  c.seq_q = 2048;
  c.head_dim = 128;

  ArgParser parser(
      "flashattn bench",
      "flashattn bench: median wall time and throughput of forward, backward and\n"
      "forward+backward on one shape and device, the peak extra memory of the calls,\n"
      "and, on the CPU, a naive float32 implementation that materialises the Sq x Skv\n"
      "matrices, side by side. Default problem: B=1 Hq=Hkv=8 S=2048 D=128, float32.");
  opt.run.add_flags(parser);
  parser.section("bench");
  parser.flag("--reps", "N", "timed calls per pass; the median is reported (default 5)",
              [&](const std::string& t) { opt.reps = static_cast<int>(parse_int("--reps", t, 1, 100000)); });
  parser.flag("--warmup", "N", "untimed forward+backward calls first (default 1)",
              [&](const std::string& t) {
                opt.warmup = static_cast<int>(parse_int("--warmup", t, 0, 100000));
              });
  parser.toggle("--no-naive", "skip the naive baseline", [&] { opt.naive = false; });
  parser.flag("--naive-max-gib", "G",
              "skip the naive baseline when its Sq x Skv matrices (P and dS, float32,\n"
              "all heads) would exceed G GiB (default 4)",
              [&](const std::string& t) {
                opt.naive_cap_gib = parse_double("--naive-max-gib", t);
                if (opt.naive_cap_gib < 0)
                  throw UsageError("--naive-max-gib: must be >= 0, got '" + t + "'");
              });
  parser.epilogue(
      "FLOPs: the library's one FLOP model (docs/PERF.md; the work line shows the\n"
      "counts). GFLOP/s on the CPU, TFLOP/s on CUDA. Times: steady_clock on the CPU,\n"
      "CUDA events on the problem's stream on CUDA.\n"
      "\n"
      "Peak extra memory (CPU only), measured over the timed calls, beyond the inputs\n"
      "and outputs that exist before them, two ways:\n"
      "  heap  exact bytes from counting replacements of the global operator new/delete\n"
      "        (libflashattn's C++ allocations resolve to them too)\n"
      "  RSS   growth of the resident-set high-water mark (VmHWM, reset through\n"
      "        /proc/self/clear_refs just before; falls back to getrusage ru_maxrss);\n"
      "        also sees malloc/mmap and thread stacks, in whole pages\n"
      "flashattn's must stay O(B*H*S) (it is also shown per query row); the naive\n"
      "baseline's is O(B*H*Sq*Skv).\n"
      "\n"
      "examples:\n"
      "  flashattn bench --seq 2048 --heads 8 --head-dim 128 --mask causal\n"
      "  flashattn bench --device cuda --batch 8 --seq 2048 --heads 16 --reps 20\n");
  if (!parser.parse(argc, argv, first)) return kExitOk;
  opt.run.finish();
  const bool on_cuda = opt.run.device >= 0;

  const double fwd_flops = testing::forward_flops(c), bwd_flops = testing::backward_flops(c);
  const double unit = on_cuda ? 1e12 : 1e9;
  const char* unit_name = on_cuda ? "TFLOP/s" : "GFLOP/s";
  {
    std::ostringstream os;
    os << "flashattn bench: " << c.describe() << "\n"
       << opt.run.describe_exec() << "; " << opt.warmup << " warm-up + " << opt.reps
       << " timed calls per pass, medians\n"
       << "work: forward " << fmt(fwd_flops / 1e9, 2) << " GFLOP, backward "
       << fmt(bwd_flops / 1e9, 2) << " GFLOP (FLOP model: docs/PERF.md)\n\n";
    emit(os.str());
  }
  const std::unique_ptr<testing::Problem> problem = make_problem(c);
  testing::Problem& p = *problem;
  DeviceProblem dp(p, opt.run.device);
  const Options lib = opt.run.library_options(dp.stream(), &dp.alibi);
  Timer timer(dp.device(), dp.stream());

  auto row = [&](const std::string& name, const Result& r) {
    auto cell = [&](double ms, double flops) {
      return rpad(fmt(ms, 2), 11) + rpad(fmt(flops / (ms * 1e-3) / unit, on_cuda ? 2 : 1), 10);
    };
    return pad(name, 11) + cell(r.fwd_ms, fwd_flops) + cell(r.bwd_ms, bwd_flops) +
           cell(r.both_ms, fwd_flops + bwd_flops) + "\n";
  };
  emit(pad("", 11) + pad("  forward", 21) + pad("  backward", 21) + "  forward+backward\n" +
       pad("impl", 11) + rpad("ms", 11) + rpad(unit_name, 10) + rpad("ms", 11) +
       rpad(unit_name, 10) + rpad("ms", 11) + rpad(unit_name, 10) + "\n");

  const Result lib_r = time_passes(
      "flashattn",
      [&] {
        try {
          forward(dp.q, dp.k, dp.v, dp.out, dp.lse, lib);
        } catch (const Error& e) {
          throw Error(e.status(), std::string("forward: ") + e.what());
        }
      },
      [&] {
        try {
          backward(dp.q, dp.k, dp.v, dp.out, dp.dout, dp.lse, dp.dq, dp.dk, dp.dv, lib);
        } catch (const Error& e) {
          throw Error(e.status(), std::string("backward: ") + e.what());
        }
      },
      timer, opt, !on_cuda);
  emit(row("flashattn", lib_r));

  // ---- naive baseline (CPU) ----
  const testing::NaiveShape ns{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, c.head_dim};
  const double naive_bytes = testing::naive_matrix_bytes(ns);
  Result naive_r;
  bool naive_ran = false;
  std::string naive_note, agreement;
  if (on_cuda) {
    naive_note = "naive baseline: CPU only, not run on CUDA\n";
  } else if (!opt.naive) {
    naive_note = "naive baseline: skipped (--no-naive)\n";
  } else if (opt.run.has_score_mods()) {
    naive_note = "naive baseline: skipped, it has no sliding window, softcap or ALiBi\n";
  } else if (naive_bytes > opt.naive_cap_gib * 1073741824.0) {
    naive_note = "naive baseline: skipped, its P and dS matrices would take " +
                 fmt_bytes(naive_bytes) + " > --naive-max-gib " + fmt(opt.naive_cap_gib, 1) +
                 " GiB\n";
  } else {
    const std::vector<float> q = to_float(p.q), k = to_float(p.k), v = to_float(p.v),
                             dout = to_float(p.dout);
    std::vector<float> out(q.size()), lse(static_cast<size_t>(c.batch * c.heads_q * c.seq_q)),
        dq(q.size()), dk(k.size()), dv(v.size());
    testing::NaiveSaved saved;
    const float scale = c.scale();
    Timer cpu_timer(kCpu, nullptr);
    auto release_saved = [&] { std::vector<float>().swap(saved.p); };
    naive_r = time_passes(
        "naive",
        [&] {
          // P is freed before each forward so that every timed call allocates it, as autograd does.
          release_saved();
          testing::naive_forward(ns, q.data(), k.data(), v.data(), scale, c.mask, out.data(),
                                 lse.data(), saved, opt.run.threads);
        },
        [&] {
          testing::naive_backward(ns, q.data(), k.data(), v.data(), dout.data(), saved, scale,
                                  dq.data(), dk.data(), dv.data(), opt.run.threads);
        },
        cpu_timer, opt, true, release_saved);
    naive_ran = true;
    emit(row("naive", naive_r));
    // The two implementations should agree to float32 accuracy: a cheap sanity check of both.
    auto diff = [&](const char* name, const std::vector<float>& naive, const testing::HostTensor& t) {
      const testing::ErrorStats e =
          testing::compare(std::vector<double>(naive.begin(), naive.end()), p.to_double(t));
      return std::string(name) + " " + sci(e.rel) + (e.nan ? " (" + std::to_string(e.nan) + " NaN)" : "");
    };
    agreement = "naive vs flashattn outputs, max abs diff / max |flashattn|: " +
                diff("out", out, p.out) + ", " + diff("lse", lse, p.lse) + ", " +
                diff("dq", dq, p.dq) + ", " + diff("dk", dk, p.dk) + ", " + diff("dv", dv, p.dv) +
                "\n";
  }
  Progress::global().finish();

  std::ostringstream os;
  if (naive_ran)
    os << "naive / flashattn time: forward " << fmt(naive_r.fwd_ms / lib_r.fwd_ms, 1)
       << "x, backward " << fmt(naive_r.bwd_ms / lib_r.bwd_ms, 1) << "x, forward+backward "
       << fmt(naive_r.both_ms / lib_r.both_ms, 1) << "x\n";
  else
    os << naive_note;
  os << "\n";
  if (on_cuda) {
    os << "peak extra memory: not measured on CUDA (allocations inside the library are not visible "
          "to the tool)\n";
  } else {
    double io_bytes = 0;
    for (const testing::HostTensor* t : {&p.q, &p.k, &p.v, &p.dout, &p.out, &p.lse, &p.dq, &p.dk, &p.dv})
      io_bytes += static_cast<double>(t->bytes.size());
    const double rows = static_cast<double>(c.batch) * c.heads_q * c.seq_q;
    MemoryMeter probe;
    os << "peak extra host memory during the timed calls (inputs and outputs, "
       << fmt_bytes(io_bytes) << ", not counted):\n"
       << pad("", 11) << rpad("heap", 12) << rpad("RSS", 12) << "   heap per query row (B*Hq*Sq = "
       << static_cast<int64_t>(rows) << ")\n";
    auto mem_row = [&](const char* name, const Result& r) {
      os << pad(name, 11) << rpad(fmt_bytes(static_cast<double>(r.heap_extra)), 12)
         << rpad(fmt_bytes(static_cast<double>(r.rss_extra)), 12) << "   "
         << fmt(static_cast<double>(r.heap_extra) / rows, 1) << " B\n";
    };
    mem_row("flashattn", lib_r);
    if (naive_ran) mem_row("naive", naive_r);
    probe.start();
    os << "for scale: one float32 Sq x Skv matrix for every (batch, head) = "
       << fmt_bytes(naive_bytes / 2) << "; heap = counted operator new, RSS = " << probe.rss_method()
       << "\n";
  }
  os << agreement;
  emit(os.str());
  return kExitOk;
}

}  // namespace flashattn::cli
