// The CPU backend's driver: picks the kernel set for this machine once (select_kernel), runs the
// kernels on the shared thread pool and owns their scratch memory.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "cpu/kernels.hpp"
#include "cpu/kvcache.hpp"
#include "cpu/thread_pool.hpp"

namespace flashattn::cpu {

bool supported(const KernelSet& k) {
#if defined(FLASHATTN_CPU_X86)
  __builtin_cpu_init();
  if (&k == &avx512::kernels)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (&k == &avx2::kernels) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return &k == &generic::kernels;
}

namespace {

// Candidates, best first.
std::vector<const KernelSet*> candidates() {
  std::vector<const KernelSet*> all;
#if defined(FLASHATTN_CPU_X86)
  all.push_back(&avx512::kernels);
  all.push_back(&avx2::kernels);
#endif
  all.push_back(&generic::kernels);
  return all;
}

// The one place that decides which kernels serve this process. FLASHATTN_CPU_ISA (avx512, avx2,
// generic) asks for a specific set, e.g. to test every path on one machine; a set the CPU cannot
// run is never chosen.
const KernelSet& pick_kernel() {
  const char* want = std::getenv("FLASHATTN_CPU_ISA");
  if (want && *want) {
    for (const KernelSet* k : candidates())
      if (std::strcmp(k->name, want) == 0 && supported(*k)) return *k;
  }
  for (const KernelSet* k : candidates())
    if (supported(*k)) return *k;
  return generic::kernels;
}

// FLASHATTN_CPU_BWD = split / fused fixes the backward's design (both give the same bits; tests
// compare them, benchmarks time them); anything else leaves it to the kernels' cost model. Read per
// call, so a test can switch it between calls.
int backward_design_asked() {
  const char* v = std::getenv("FLASHATTN_CPU_BWD");
  if (v == nullptr) return Parallel::kAuto;
  if (std::strcmp(v, "split") == 0) return Parallel::kSplit;
  if (std::strcmp(v, "fused") == 0) return Parallel::kFused;
  return Parallel::kAuto;
}

struct AlignedFree {
  void operator()(void* p) const { ::operator delete(p, std::align_val_t(64)); }
};
using Buffer = std::unique_ptr<void, AlignedFree>;

Buffer allocate(size_t bytes) {
  void* p = ::operator new(bytes == 0 ? 64 : bytes, std::align_val_t(64), std::nothrow);
  if (!p)
    throw Error(Status::OutOfMemory,
                "cpu backend: cannot allocate " + std::to_string(bytes) + " bytes of scratch");
  return Buffer(p);
}

// Per-thread scratch survives between calls (attached to the leased pool: one call at a time
// uses it) so small problems do not pay for fresh pages every time.
struct ScratchCache {
  std::vector<Buffer> bufs;
  std::vector<size_t> sizes;
  // Slots for `threads` threads, made before a run (the vectors are not resized during it).
  void reserve(size_t threads) {
    if (bufs.size() < threads) {
      bufs.resize(threads);
      sizes.resize(threads, 0);
    }
  }
  // Slot t's buffer, grown to `bytes` on its first use: threads that find no task (more threads
  // than tasks) allocate nothing.
  void* slot(size_t t, size_t bytes) {
    Buffer& buf = bufs[t];
    size_t& size = sizes[t];
    if (bytes > 0 && size < bytes) {
      buf.reset();
      size = 0;
      buf = allocate(bytes);
      size = bytes;
    }
    return buf.get();
  }
};

// What both ways of running a call share: memory that lives until the call returns, and
// options.cancel: with it set, every task first polls it, and once it returned nonzero the
// remaining tasks are skipped and run() throws Cancelled (so a multi-pass call stops at the pass
// it was in). run_tasks() is the way of running tasks.
class CallParallel : public Parallel {
 public:
  void* alloc(size_t bytes) override {
    owned_.push_back(allocate(bytes));
    return owned_.back().get();
  }
  void run(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) final {
    if (cancel_ == nullptr) return run_tasks(num_tasks, scratch_bytes, fn, ctx);
    const Polled pl{fn, ctx, this};
    run_tasks(num_tasks, scratch_bytes, &polled, &pl);
    if (stopped_.load()) throw Error(Status::Cancelled, "cancelled by options.cancel during the call");
  }

 protected:
  CallParallel(const Exec& e, int threads)
      : Parallel(threads, backward_design_asked()), cancel_(e.cancel), cancel_arg_(e.cancel_arg) {}
  ~CallParallel() = default;
  virtual void run_tasks(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) = 0;

 private:
  struct Polled {
    TaskFn fn;
    const void* ctx;
    CallParallel* self;
  };
  static void polled(const void* c, int64_t task, void* scratch) {
    const Polled& pl = *static_cast<const Polled*>(c);
    CallParallel& s = *pl.self;
    if (s.stopped_.load(std::memory_order_relaxed)) return;
    if (s.cancel_(s.cancel_arg_) != 0) {
      s.stopped_.store(true);
      return;
    }
    pl.fn(pl.ctx, task, scratch);
  }

  std::vector<Buffer> owned_;
  int (*cancel_)(void*);
  void* cancel_arg_;
  std::atomic<bool> stopped_{false};
};

class PoolParallel final : public CallParallel {
 public:
  PoolParallel(const Exec& e, PoolLease& lease)
      : CallParallel(e, lease.pool().threads()), pool_(lease.pool()), scratch_(lease.attached<ScratchCache>()) {}

 private:
  void run_tasks(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) override {
    scratch_.reserve(static_cast<size_t>(pool_.threads()));
    Job job{fn, ctx, scratch_bytes, &scratch_};
    pool_.run(num_tasks, &trampoline, &job);
  }

  struct Job {
    TaskFn fn;
    const void* ctx;
    size_t scratch_bytes;
    ScratchCache* cache;
  };
  static void trampoline(const void* j, int64_t task, int thread) {
    const Job& job = *static_cast<const Job*>(j);
    job.fn(job.ctx, task, job.cache->slot(static_cast<size_t>(thread), job.scratch_bytes));
  }

  ThreadPool& pool_;
  ScratchCache& scratch_;
};

// The calls' tasks on a framework's team of threads (set_team_runner): every team member drains
// the same task counter, as the pool's threads do. A member takes its scratch slot from a counter
// of its own (not from the runner's thread number, which the library need not trust), members
// beyond `threads` return at once, and a task's exception is kept and rethrown here after the
// runner returns (never thrown through the runner's frames).
class TeamParallel final : public CallParallel {
 public:
  TeamParallel(const Exec& e, TeamRunner run, void* ctx, ScratchCache& sc)
      : CallParallel(e, e.num_threads), run_(run), ctx_(ctx), scratch_(sc) {}

 private:
  void run_tasks(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) override {
    if (num_tasks <= 0) return;
    scratch_.reserve(static_cast<size_t>(threads()));
    Team team;
    team.fn = fn;
    team.ctx = ctx;
    team.scratch_bytes = scratch_bytes;
    team.cache = &scratch_;
    team.num_tasks = num_tasks;
    team.slots = threads();
    // A single task, or a single thread, runs inline: waking a team costs more than it gives.
    if (num_tasks == 1 || threads() == 1) body(&team, 0);
    else run_(ctx_, threads(), &body, &team);
    if (team.error) std::rethrow_exception(team.error);
    if (team.next_task.load() < num_tasks) {
      // The runner returned without any member having run (a runner that calls body zero
      // times): finish on this thread rather than leave outputs unwritten.
      body(&team, 0);
      if (team.error) std::rethrow_exception(team.error);
    }
  }

  struct Team {
    TaskFn fn;
    const void* ctx;
    size_t scratch_bytes;
    ScratchCache* cache;
    int64_t num_tasks;
    int slots;
    std::atomic<int64_t> next_task{0};
    std::atomic<int> next_slot{0};
    std::mutex mu;
    std::exception_ptr error;
  };
  static void body(void* arg, int32_t /*thread*/) {
    Team& team = *static_cast<Team*>(arg);
    const int slot = team.next_slot.fetch_add(1);
    if (slot >= team.slots) return;
    const size_t t = static_cast<size_t>(slot);
    for (;;) {
      const int64_t task = team.next_task.fetch_add(1);
      if (task >= team.num_tasks) return;
      try {
        team.fn(team.ctx, task, team.cache->slot(t, team.scratch_bytes));
      } catch (...) {
        const std::lock_guard<std::mutex> g(team.mu);
        if (!team.error) team.error = std::current_exception();
        team.next_task.store(team.num_tasks);  // skip the rest
      }
    }
  }

  TeamRunner run_;
  void* ctx_;
  ScratchCache& scratch_;
};

// The installed runner (flashattn_set_cpu_team_runner); read once per call.
struct Runner {
  TeamRunner run = nullptr;
  void* ctx = nullptr;
};
std::mutex g_runner_mu;
Runner g_runner;
Runner current_runner() {
  const std::lock_guard<std::mutex> g(g_runner_mu);
  return g_runner;
}

// Runs one backend call's kernels on the installed team, or on a leased pool.
template <class Call>
void with_parallel(const Exec& e, Call&& call) {
  const Runner r = current_runner();
  // (A lease of a one-thread pool starts no thread; it serves this call's scratch only.)
  PoolLease lease(r.run != nullptr ? 1 : e.num_threads);
  if (r.run != nullptr) {
    TeamParallel par(e, r.run, r.ctx, lease.attached<ScratchCache>());
    call(static_cast<Parallel&>(par));
  } else {
    PoolParallel par(e, lease);
    call(static_cast<Parallel&>(par));
  }
}

// A call whose work is smaller than what waking a team of threads costs runs on the calling
// thread: a wake-up is a futex round trip per thread - for PyTorch's intra-op team on the 2-core
// VM a tiny forward+backward took 186 us on 2 threads against 86 on one (SDPA: 54), 2026-12-06,
// bench/host_overhead.py --device cpu --shape 1,1,16,16. Below 2^22 forward FLOPs (~50 us on one
// core at the kernels' ~90 GFLOP/s; PyTorch keeps its own small ops serial by a grain size too)
// the call's threads are one. (Packed and KV-cache calls count their padded extents: an upper
// bound.)
constexpr double kSerialFlops = 4194304.0;
Exec serial_if_small(const Exec& e, const Shape& s) {
  Exec r = e;
  const double flops = 4.0 * static_cast<double>(s.batch) * static_cast<double>(s.heads_q) *
                       static_cast<double>(s.seq_q) * static_cast<double>(s.seq_kv) * static_cast<double>(s.head_dim);
  if (flops < kSerialFlops) r.num_threads = 1;
  return r;
}

// The mask the API asked for (mask and sliding window), as the band every kernel iterates and
// masks by. (Softcap and ALiBi reach the kernels through p.num.)
MaskRule rule_of(const Shape& s, const Numerics& n) { return mask_rule(s, n); }

// A KV-cache call on `par`: the append and the rotated q (kvcache.cpp; the rotated q lives for the
// call, B * Hq * Sq * D elements of the call's dtype), then the forward kernel over the caches.
void run_kvcache(const KernelSet& k, const KvcacheParams& kp, Parallel& par) {
  const Shape& sh = kp.fwd.shape;
  void* q_rot = kp.rotary.cos != nullptr
                    ? par.alloc(static_cast<size_t>(sh.batch * sh.heads_q * sh.seq_q * sh.head_dim *
                                                    element_bytes(kp.fwd.num.dtype)))
                    : nullptr;
  ForwardParams p = kp.fwd;
  p.q = kvcache_prepare(kp, q_rot);
  k.forward(p, rule_of(p.shape, p.num), par);
}

}  // namespace

const KernelSet& select_kernel() {
  static const KernelSet& k = pick_kernel();
  return k;
}

// (Concurrent calls lease pools, or scratch, of their own: with_parallel.)
void forward(const ForwardParams& p) {
  const KernelSet& k = select_kernel();
  with_parallel(serial_if_small(p.exec, p.shape), [&](Parallel& par) { k.forward(p, rule_of(p.shape, p.num), par); });
}

void forward_kvcache(const KvcacheParams& kp) {
  const KernelSet& k = select_kernel();
  with_parallel(serial_if_small(kp.fwd.exec, kp.fwd.shape), [&](Parallel& par) { run_kvcache(k, kp, par); });
}

void backward(const BackwardParams& p) {
  const KernelSet& k = select_kernel();
  with_parallel(serial_if_small(p.exec, p.shape), [&](Parallel& par) { k.backward(p, rule_of(p.shape, p.num), par); });
}

void set_team_runner(TeamRunner run, void* ctx) {
  const std::lock_guard<std::mutex> g(g_runner_mu);
  g_runner = Runner{run, ctx};
}

std::string describe() {
  const KernelSet& k = select_kernel();
  std::ostringstream os;
  os << "isa " << k.name << " (" << k.vector_bytes * 8 << "-bit vectors; built:";
  for (const KernelSet* c : candidates()) os << " " << c->name << (supported(*c) ? "" : "(no cpu)");
  os << "), tiles " << k.block_q << " queries x " << k.block_kv
     << " keys, kernels: forward (online softmax), backward (D preprocess, then dQ and dK/dV passes "
        "or one fused pass per (batch, kv head), by a cost model), "
        "hardware threads "
     << std::thread::hardware_concurrency()
     << (current_runner().run != nullptr ? ", calls run on a caller's thread team (flashattn_set_cpu_team_runner)"
                                         : ", calls run on the library's thread pools");
  return os.str();
}

}  // namespace flashattn::cpu
