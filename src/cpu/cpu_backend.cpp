// The CPU backend's driver: picks the kernel set for this machine once (select_kernel), runs the
// kernels on the shared thread pool and owns their scratch memory.
#include <cstdlib>
#include <cstring>
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

// Per-thread scratch survives between calls (guarded by the pool lock) so small problems do not
// pay for fresh pages every time.
struct ScratchCache {
  std::vector<Buffer> bufs;
  std::vector<size_t> sizes;
};
ScratchCache& scratch_cache() {
  static ScratchCache c;
  return c;
}

class PoolParallel final : public Parallel {
 public:
  PoolParallel(ThreadPool& pool) : pool_(pool) {}

  void run(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) override {
    ScratchCache& sc = scratch_cache();
    const size_t n = static_cast<size_t>(pool_.threads());
    if (sc.bufs.size() < n) {
      sc.bufs.resize(n);
      sc.sizes.resize(n, 0);
    }
    // Each thread grows its own slot on first use, so threads that find no task (more threads
    // than tasks) allocate nothing; the vectors themselves are not resized during the run.
    Job job{fn, ctx, scratch_bytes, &sc};
    pool_.run(num_tasks, &trampoline, &job);
  }

  void* alloc(size_t bytes) override {
    owned_.push_back(allocate(bytes));
    return owned_.back().get();
  }

 private:
  struct Job {
    TaskFn fn;
    const void* ctx;
    size_t scratch_bytes;
    ScratchCache* cache;
  };
  static void trampoline(const void* j, int64_t task, int thread) {
    const Job& job = *static_cast<const Job*>(j);
    const size_t t = static_cast<size_t>(thread);
    Buffer& buf = job.cache->bufs[t];
    size_t& size = job.cache->sizes[t];
    if (job.scratch_bytes > 0 && size < job.scratch_bytes) {
      buf.reset();
      size = 0;
      buf = allocate(job.scratch_bytes);
      size = job.scratch_bytes;
    }
    job.fn(job.ctx, task, buf.get());
  }

  ThreadPool& pool_;
  std::vector<Buffer> owned_;
};

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

void forward(const ForwardParams& p) {
  const KernelSet& k = select_kernel();
  std::unique_lock<std::mutex> lock;
  ThreadPool& pool = shared_pool(p.exec.num_threads, lock);
  PoolParallel par(pool);
  k.forward(p, rule_of(p.shape, p.num), par);
}

void forward_kvcache(const KvcacheParams& kp) {
  const KernelSet& k = select_kernel();
  std::unique_lock<std::mutex> lock;
  ThreadPool& pool = shared_pool(kp.fwd.exec.num_threads, lock);
  PoolParallel par(pool);
  run_kvcache(k, kp, par);
}

void backward(const BackwardParams& p) {
  const KernelSet& k = select_kernel();
  std::unique_lock<std::mutex> lock;
  ThreadPool& pool = shared_pool(p.exec.num_threads, lock);
  PoolParallel par(pool);
  k.backward(p, rule_of(p.shape, p.num), par);
}

std::string describe() {
  const KernelSet& k = select_kernel();
  std::ostringstream os;
  os << "isa " << k.name << " (" << k.vector_bytes * 8 << "-bit vectors; built:";
  for (const KernelSet* c : candidates()) os << " " << c->name << (supported(*c) ? "" : "(no cpu)");
  os << "), tiles " << k.block_q << " queries x " << k.block_kv
     << " keys, kernels: forward (online softmax), backward (D preprocess, dQ pass, dK/dV pass), "
        "hardware threads "
     << std::thread::hardware_concurrency();
  return os.str();
}

}  // namespace flashattn::cpu
