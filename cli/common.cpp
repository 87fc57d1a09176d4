#include "common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <sstream>

namespace flashattn::cli {

// ---- run options -----------------------------------------------------------------------------

void RunOptions::add_flags(ArgParser& p) {
  testing::ProblemConfig& c = problem;
  auto dim = [](int64_t max) {
    return [max](int64_t* dst, const std::string& flag) {
      return [dst, flag, max](const std::string& t) { *dst = parse_int(flag, t, 1, max); };
    };
  };
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  constexpr int64_t kMaxHeadDim = 256;  // the library's limit (a larger one is Unsupported)
  p.section("problem");
  p.flag("--batch", "B", "batch size (default " + std::to_string(c.batch) + ")",
         dim(kMaxDim)(&c.batch, "--batch"), {"-b"});
  p.flag("--heads", "H", "query heads Hq (default " + std::to_string(c.heads_q) + ")",
         dim(kMaxDim)(&c.heads_q, "--heads"));
  p.flag("--kv-heads", "H",
         "key/value heads Hkv; must divide --heads (default: = --heads;\n"
         "fewer gives GQA, 1 gives MQA)",
         [this](const std::string& t) {
           problem.heads_kv = parse_int("--kv-heads", t, 1, kMaxDim);
           heads_kv_set = true;
         });
  p.flag("--seq-q", "S", "query sequence length Sq (default " + std::to_string(c.seq_q) + ")",
         dim(kMaxDim)(&c.seq_q, "--seq-q"), {"--seq"});
  p.flag("--seq-kv", "S", "key/value sequence length Skv (default: = --seq-q)",
         [this](const std::string& t) {
           problem.seq_kv = parse_int("--seq-kv", t, 1, kMaxDim);
           seq_kv_set = true;
         });
  p.flag("--head-dim", "D",
         "head dimension (default " + std::to_string(c.head_dim) +
             "; the library accepts 1..256)",
         dim(kMaxHeadDim)(&c.head_dim, "--head-dim"), {"--dim"});
  p.flag("--mask", "M",
         "none | causal | causal_top_left | causal_bottom_right (default none).\n"
         "causal = causal_top_left: key j visible to query i when j <= i;\n"
         "causal_bottom_right: j <= i + Skv - Sq (FlashAttention's causal).\n"
         "The two differ only when Sq != Skv",
         [this](const std::string& t) {
           static const std::vector<std::string> names = {"none", "causal", "causal_top_left",
                                                          "causal_bottom_right"};
           static const Mask masks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalTopLeft,
                                        Mask::CausalBottomRight};
           problem.mask = masks[parse_choice("--mask", t, names)];
         });
  p.flag("--dtype", "T",
         "float32 | float16 | bfloat16 | float64 (default float32) for q, k, v, out and\n"
         "the gradients; lse is always float32. float64 runs on the CPU only",
         [this](const std::string& t) {
           static const DType types[] = {DType::Float32, DType::Float16, DType::BFloat16,
                                         DType::Float64};
           problem.dtype =
               types[parse_choice("--dtype", t, {"float32", "float16", "bfloat16", "float64"})];
         });
  p.flag("--layout", "L",
         "memory order of q, k, v and the rest: bhsd ([B,H,S,D]) or bshd\n"
         "([B,S,H,D], FlashAttention's) (default bhsd)",
         [this](const std::string& t) {
           problem.layout = parse_choice("--layout", t, {"bhsd", "bshd"}) == 0
                                ? testing::Layout::BHSD
                                : testing::Layout::BSHD;
         });
  p.flag("--scale", "X",
         "softmax scale, |X| <= 1e6 (default 0 = 1/sqrt(head_dim))",
         [this](const std::string& t) {
           const double v = parse_double("--scale", t);
           const float f = static_cast<float>(v);
           // The library's bound, checked here on the float the library would get.
           if (!std::isfinite(f) || std::fabs(f) > FLASHATTN_MAX_SOFTMAX_SCALE)
             throw UsageError("--scale: " + t + " is out of range (|scale| must be <= 1e6)");
           if (f == 0.0f && v != 0.0)
             throw UsageError("--scale: " + t +
                              " rounds to 0 in float32, which means the default 1/sqrt(head_dim)");
           problem.softmax_scale = f;
         });
  p.flag("--window", "L,R",
         "sliding window, FlashAttention's window_size: key j visible to query i\n"
         "when i + Skv - Sq - L <= j <= i + Skv - Sq + R; -1 leaves a side\n"
         "unbounded (default -1,-1: none); combined with --mask",
         [this](const std::string& t) {
           const size_t comma = t.find(',');
           if (comma == std::string::npos || t.find(',', comma + 1) != std::string::npos)
             throw UsageError("--window: expected L,R (two integers, -1 = unbounded), got '" + t + "'");
           auto side = [&](const std::string& x) {
             try {
               return parse_int("--window", x, -1, std::numeric_limits<int64_t>::max());
             } catch (const UsageError&) {
               throw UsageError("--window: expected L,R with each side -1 (unbounded) or >= 0, got '" +
                                t + "'");
             }
           };
           problem.window_left = side(t.substr(0, comma));
           problem.window_right = side(t.substr(comma + 1));
         });
  p.flag("--softcap", "X",
         "logit softcap: scores s become X * tanh(s / X) (Gemma 2); X > 0 and\n"
         "finite, 0 = none (default 0)",
         [this](const std::string& t) {
           const double v = parse_double("--softcap", t);
           const float f = static_cast<float>(v);
           if (!(v >= 0) || !std::isfinite(f))
             throw UsageError("--softcap: " + t + " is out of range (0 for none, or a finite value > 0)");
           if (f == 0.0f && v != 0.0)
             throw UsageError("--softcap: " + t + " rounds to 0 in float32, which means no softcap");
           problem.softcap = f;
         });
  p.flag("--alibi", "S",
         "none | heads | batch: ALiBi slopes (default none). heads: the ALiBi\n"
         "paper's 2^(-8 (h+1) / Hq) for query head h, one [Hq] tensor; batch: a\n"
         "[B, Hq] tensor, batch b's slopes those times 1 + b/2",
         [this](const std::string& t) {
           static const testing::AlibiKind kinds[] = {testing::AlibiKind::None, testing::AlibiKind::Heads,
                                                      testing::AlibiKind::BatchHeads};
           problem.alibi = kinds[parse_choice("--alibi", t, {"none", "heads", "batch"})];
         });
  p.flag("--seed", "N", "seed of the random inputs, drawn from N(0,1) (default 0)",
         [this](const std::string& t) {
           problem.seed = static_cast<uint64_t>(
               parse_int("--seed", t, 0, std::numeric_limits<int64_t>::max()));
         });
  p.section("execution");
  p.flag("--device", "DEV",
         "cpu | cuda | cuda:N (default: cuda:0 when a CUDA device is usable,\nelse cpu)",
         [this](const std::string& t) {
           device_text = t;
           if (t == "cpu" || t == "cuda") return;
           if (t.compare(0, 5, "cuda:") == 0) {
             try {
               parse_int("--device", t.substr(5), 0, 1023);
               return;
             } catch (const UsageError&) {
               // reported below, with the whole value
             }
           }
           throw UsageError("--device: expected cpu, cuda or cuda:N (N in 0..1023), got '" + t + "'");
         });
  p.flag("--threads", "N",
         "CPU threads for the library, the reference and the naive baseline,\n"
         "at most 1024 (default 0 = all hardware threads)",
         [this](const std::string& t) {
           threads = static_cast<int>(parse_int("--threads", t, 0, FLASHATTN_MAX_THREADS));
         });
  p.flag("--precision", "P",
         "fp32 | tf32: how float32 is multiplied on CUDA (default fp32, as\n"
         "accurate as plain float32; tf32 is faster, ~1e-3 relative error).\n"
         "Ignored on the CPU",
         [this](const std::string& t) {
           precision = parse_choice("--precision", t, {"fp32", "tf32"}) == 0 ? Precision::Fp32
                                                                              : Precision::Tf32;
         });
  p.toggle("--progress", "always show the progress line (default: only when stderr is a\nterminal)",
           [this] { progress = 1; });
  p.toggle("--no-progress", "never show the progress line", [this] { progress = 0; });
}

void RunOptions::finish() {
  if (!heads_kv_set) problem.heads_kv = problem.heads_q;
  if (!seq_kv_set) problem.seq_kv = problem.seq_q;
  if (problem.heads_q % problem.heads_kv != 0)
    throw UsageError("--kv-heads " + std::to_string(problem.heads_kv) + " must divide --heads " +
                     std::to_string(problem.heads_q));
  // Index arithmetic (here and in the library) must fit in int64; anything near that is a typo.
  if (problem_bytes(problem) > 0x1p60)
    throw UsageError("the problem would take " + fmt_bytes(problem_bytes(problem)) +
                     " of host memory: check --batch, --heads, --seq and --head-dim");
  if (device_text == "auto")
    device = cuda_available() ? 0 : kCpu;
  else if (device_text == "cpu")
    device = kCpu;
  else if (device_text == "cuda")
    device = 0;
  else
    device = static_cast<int32_t>(std::stoi(device_text.substr(5)));
  Progress::global().enable(progress == 1 || (progress == -1 && isatty(STDERR_FILENO)));
}

Options RunOptions::library_options(void* stream, const Tensor* alibi) const {
  Options o;
  o.softmax_scale = problem.softmax_scale;
  o.mask = problem.mask;
  o.stream = stream;
  o.num_threads = threads;
  o.precision = precision;
  o.window_left = problem.window_left;
  o.window_right = problem.window_right;
  o.softcap = problem.softcap;
  o.alibi_slopes = problem.alibi != testing::AlibiKind::None ? alibi : nullptr;
  return o;
}

bool RunOptions::has_score_mods() const {
  return problem.has_window() || problem.softcap != 0.0f || problem.alibi != testing::AlibiKind::None;
}

int RunOptions::resolved_threads() const {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();  // as the library resolves 0
  return hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, FLASHATTN_MAX_THREADS));
}

double problem_bytes(const testing::ProblemConfig& c) {
  const double es = static_cast<double>(dtype_size(c.dtype));
  const double q = static_cast<double>(c.batch) * c.heads_q * c.seq_q;
  const double kv = static_cast<double>(c.batch) * c.heads_kv * c.seq_kv;
  const double slopes = c.alibi == testing::AlibiKind::None ? 0
                        : 4.0 * c.heads_q * (c.alibi == testing::AlibiKind::BatchHeads ? c.batch : 1);
  return es * c.head_dim * (4 * q + 4 * kv) + 4 * q + slopes;
}

std::unique_ptr<testing::Problem> make_problem(const testing::ProblemConfig& c) {
  try {
    return std::make_unique<testing::Problem>(c);
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory,
                "allocating the problem's host buffers (" + fmt_bytes(problem_bytes(c)) + ") failed");
  } catch (const std::length_error&) {
    throw Error(Status::OutOfMemory,
                "allocating the problem's host buffers (" + fmt_bytes(problem_bytes(c)) + ") failed");
  }
}

std::string device_string(int32_t device) {
  return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device);
}

std::string RunOptions::device_name() const { return device_string(device); }

std::string RunOptions::describe_exec() const {
  std::ostringstream os;
  os << "device " << device_name();
  if (device < 0)
    os << ", " << resolved_threads() << " threads";
  else
    os << ", precision " << precision_name(precision);
  os << ", softmax scale " << problem.scale();
  if (problem.has_window())
    os << ", window (" << problem.window_left << ", " << problem.window_right << ")";
  if (problem.softcap != 0.0f) os << ", softcap " << problem.softcap;
  if (problem.alibi != testing::AlibiKind::None)
    os << ", ALiBi slopes " << testing::alibi_name(problem.alibi);
  return os.str();
}

// ---- progress ----------------------------------------------------------------------------------

Progress& Progress::global() {
  static Progress p;
  return p;
}

void Progress::enable(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on == on_ || stop_) return;
  on_ = on;
  if (on_) ticker_ = std::thread([this] { loop(); });
}

void Progress::stage(const std::string& label, int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  label_.reserve(128);  // once: later stages then reuse the buffer, allocating nothing
  label_ = label;
  total_ = total;
  done_ = 0;
  stage_start_ = std::chrono::steady_clock::now();
  if (shown_) draw_locked();
}

void Progress::advance(int64_t n) { done_ += n; }

void Progress::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    erase_locked();
  }
  cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
}

Progress::~Progress() { finish(); }

void Progress::emit(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  erase_locked();
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

void Progress::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(250));
    if (stop_) break;
    const double since = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (since >= kDelay && !label_.empty()) draw_locked();
  }
}

// Drawing and erasing use fixed buffers: the ticker runs while `bench` counts heap bytes.
void Progress::erase_locked() {
  if (!shown_) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(shown_), "");
  std::fflush(stderr);
  shown_ = 0;
}

void Progress::draw_locked() {
  if (!on_ || stop_) return;
  const double t =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stage_start_).count();
  const long long done = done_, total = total_, secs = static_cast<long long>(t);
  char line[256];
  int n;
  if (total > 0 && done > 0 && done < total)
    n = std::snprintf(line, sizeof line, "%s: %lld/%lld, ~%lld s left (%lld s)", label_.c_str(),
                      done, total, static_cast<long long>(std::ceil(t * (total - done) / done)),
                      secs);
  else if (total > 0)
    n = std::snprintf(line, sizeof line, "%s: %lld/%lld (%lld s)", label_.c_str(), done, total, secs);
  else
    n = std::snprintf(line, sizeof line, "%s (%lld s)", label_.c_str(), secs);
  const size_t width = std::min(static_cast<size_t>(std::max(n, 0)), sizeof line - 1);
  // Pad with spaces over what a longer previous line left.
  std::fprintf(stderr, "\r%s%*s", line, static_cast<int>(shown_ > width ? shown_ - width : 0), "");
  std::fflush(stderr);
  shown_ = std::max(width, shown_);
}

void emit(const std::string& text) { Progress::global().emit(text); }

// ---- helpers -------------------------------------------------------------------------------

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string fmt(double v, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}

std::string sci(double v, int precision) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(precision) << v;
  return os.str();
}

std::string fmt_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  const double sign = b < 0 ? -1 : 1;
  b = std::fabs(b);
  while (b >= 1024 && u < 6) {
    b /= 1024;
    ++u;
  }
  if (b >= 1024) return sci(sign * b, 1) + " " + units[u];
  return fmt(sign * b, u == 0 ? 0 : 1) + " " + units[u];
}

std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

std::string rpad(const std::string& s, size_t width) {
  return s.size() >= width ? s : std::string(width - s.size(), ' ') + s;
}

const char* precision_name(Precision p) { return p == Precision::Tf32 ? "tf32" : "fp32"; }

namespace {
// Calls f(logical_index, element_offset) for every element of a 3-d or 4-d view.
template <class F>
void for_each_element(const Tensor& t, F&& f) {
  const int64_t d3 = t.ndim == 4 ? t.shape[3] : 1, s3 = t.ndim == 4 ? t.stride[3] : 0;
  int64_t lin = 0;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c) {
        const int64_t base = a * t.stride[0] + b * t.stride[1] + c * t.stride[2];
        for (int64_t d = 0; d < d3; ++d) f(lin++, base + d * s3);
      }
}
}  // namespace

std::vector<float> to_float(const testing::HostTensor& t) {
  std::vector<float> r(static_cast<size_t>(t.numel()));
  for_each_element(t.view, [&](int64_t i, int64_t off) {
    r[static_cast<size_t>(i)] = static_cast<float>(testing::load_element(t.view.data, t.view.dtype, off));
  });
  return r;
}

void store_logical(testing::HostTensor& t, const float* values) {
  for_each_element(t.view, [&](int64_t i, int64_t off) {
    testing::store_element(t.view.data, t.view.dtype, off, values[i]);
  });
}

double median(std::vector<double>& v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace flashattn::cli
