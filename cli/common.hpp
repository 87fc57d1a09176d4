// Pieces shared by the subcommands: the flags that describe a problem and where it runs, exit
// codes, the progress line, and small formatting helpers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "args.hpp"
#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"

namespace flashattn::cli {

// Exit statuses (also listed in `flashattn --help`).
enum ExitCode : int {
  kExitOk = 0,
  kExitCheckFailed = 1,  // an output is NaN, unwritten or beyond tolerance
  kExitUsage = 2,        // bad command line
  kExitError = 3,        // the library or the CUDA runtime reported an error, or out of memory
  kExitUnsupported = 4,  // valid request that this build cannot serve (Status::Unsupported)
};

// Flags shared by `check` and `bench`: the problem and where and how it runs.
struct RunOptions {
  testing::ProblemConfig problem;
  bool heads_kv_set = false, seq_kv_set = false;
  std::string device_text = "auto";
  int32_t device = kCpu;  // resolved by finish(): -1 CPU, n CUDA device n
  int threads = 0;        // 0 = all hardware threads
  Precision precision = Precision::Fp32;
  int progress = -1;      // -1 auto (when stderr is a terminal), 0 off, 1 on

  // Registers the flags; the defaults shown in --help are the current field values.
  void add_flags(ArgParser& parser);
  // Applies dependent defaults (kv heads = heads, seq_kv = seq_q), resolves the device and checks
  // what the library would only catch later (Hkv dividing Hq). Throws UsageError.
  void finish();
  // The library's options; `alibi` is the slopes' view on the run's device (DeviceProblem::alibi)
  // when the problem has ALiBi.
  Options library_options(void* stream, const Tensor* alibi) const;
  // Whether a sliding window, softcap or ALiBi is set (the naive baseline has none of them).
  bool has_score_mods() const;
  int resolved_threads() const;
  std::string device_name() const;
  std::string describe_exec() const;  // "device cpu, 2 threads, precision fp32, scale 0.125"
};

std::string device_string(int32_t device);

// Bytes of a Problem's host buffers (q, k, v, dout, out, dq, dk, dv in the dtype; lse float32).
double problem_bytes(const testing::ProblemConfig& c);
// Allocates and fills the problem; a failed allocation becomes Error(OutOfMemory) with the size.
std::unique_ptr<testing::Problem> make_problem(const testing::ProblemConfig& c);

// ---- progress line ---------------------------------------------------------------------------
// One line on stderr, redrawn in place with '\r' a few times a second, shown only once a command
// has run longer than kDelay. All normal output goes through emit() so the two never interleave.
class Progress {
 public:
  static Progress& global();
  void enable(bool on);
  // Starts a stage of `total` units (0 when the stage cannot count its work).
  void stage(const std::string& label, int64_t total = 0);
  void advance(int64_t n = 1);
  void finish();  // erases the line and stops redrawing (idempotent)
  // Prints text to stdout with the progress line out of the way.
  void emit(const std::string& text);
  ~Progress();

 private:
  Progress() = default;
  void loop();
  void erase_locked();
  void draw_locked();
  static constexpr double kDelay = 2.0;  // seconds
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread ticker_;
  bool on_ = false, stop_ = false;
  size_t shown_ = 0;  // width of the line currently drawn, 0 when none
  std::string label_;
  int64_t total_ = 0;
  std::atomic<int64_t> done_{0};
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), stage_start_;
};

void emit(const std::string& text);  // Progress::global().emit

// ---- helpers ---------------------------------------------------------------------------------
double now_seconds();
std::string fmt(double v, int precision = 3);   // fixed, e.g. "12.345"
std::string sci(double v, int precision = 2);   // scientific, e.g. "1.23e-05"
std::string fmt_bytes(double bytes);            // "12.0 MiB"
std::string pad(const std::string& s, size_t width);   // left-aligned
std::string rpad(const std::string& s, size_t width);  // right-aligned
const char* precision_name(Precision p);

// Logical [B,H,S,D] (or [B,H,S]) contiguous float32 copy of a host tensor, and the reverse.
std::vector<float> to_float(const testing::HostTensor& t);
void store_logical(testing::HostTensor& t, const float* values);

// Median of a sample; sorts it in place (allocates nothing: bench calls it while counting).
double median(std::vector<double>& v);

}  // namespace flashattn::cli
