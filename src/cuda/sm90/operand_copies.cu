// The Hopper float32 kernels' operand copies (tf32-rounded rows, transposed copies and, for the
// fp32-accurate kernels, the small parts): the whole-GPU kernel before a pass and the narrow one
// that runs on a few multiprocessors beside the dQ pass.
#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/sm80/launch_fp32.cuh"
#include "cuda/sm90/mbarrier.cuh"

namespace flashattn::cuda {
namespace dev {

// x rounded to tf32, and (the fp32-accurate kernels' small part) the rest x - tf32(x) rounded too:
// 0 for an infinite x (inf - inf would make every product with it NaN instead of infinite) and for
// a NaN one (whose big part is NaN), as tf32_split (device.cuh).
__device__ __forceinline__ float tf32_big(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ float tf32_small(float x) {
  const float rest = x - tf32_big(x);
  return rest == rest ? __uint_as_float(to_tf32(rest)) : 0.0f;
}
__device__ __forceinline__ float4 tf32_big(float4 v) {
  return make_float4(tf32_big(v.x), tf32_big(v.y), tf32_big(v.z), tf32_big(v.w));
}
__device__ __forceinline__ float4 tf32_small(float4 v) {
  return make_float4(tf32_small(v.x), tf32_small(v.y), tf32_small(v.z), tf32_small(v.w));
}

// The Hopper float32 kernels' operand copies (the backwards, sm90/tf32_bwd.cuh; the 3xTF32
// forward, sm90/x3_fwd.cuh): from X [B, H, S, D]
// (any strides), xr = X rounded to tf32, contiguous [B, H, S, DP] with columns D..DP zero, and
// when xt is set the same values transposed, contiguous [B, H, DP, S8] (S8 = S rounded up to 8)
// with position n of each group of 8 in column tf32_slot(n) and the columns past S zero (a NaN
// there would survive its zero probability). kSplit (the fp32-accurate kernels): xs and xts take
// the small parts X - tf32(X), rounded to tf32, in the same layouts. Each output is optional
// (nullptr: not written; the 3xTF32 forward wants K's rows and V's transposed only). One CTA:
// 64 rows of one (b, h), staged in shared memory as read so that every output is written in whole
// coalesced rows. kVec (D = DP and X's rows 16-byte aligned, the usual case): 16-byte loads and
// stores, all DP / 16 of a thread's loads in flight at once - the scalar loop moved 2.4 TB/s
// (measured on an H200), a quarter of the call at S = 1k.
// One unit of the copies: rows [n0, n0 + 64) of one (b, h) (bh = b * heads + h), by the 256
// threads tid of a group that owns `tile` and meets at `sync` (the whole CTA, or a named barrier).
template <int DP, bool kVec, bool kSplit, class Sync>
__device__ __forceinline__ void tf32_operand_unit(const In4& x, int64_t b, int64_t h, int64_t bh, int64_t n0,
                                                  int64_t seq, int head_dim, int64_t seq8, float* xr, float* xt,
                                                  float* xs, float* xts, float (*tile)[DP + 1], int tid, Sync sync) {
  const float* src = static_cast<const float*>(x.ptr) + b * x.sb + h * x.sh;
  float* dst = xr != nullptr ? xr + bh * seq * DP : nullptr;
  float* dsts = kSplit && xs != nullptr ? xs + bh * seq * DP : nullptr;
  if constexpr (kVec) {
    // Loads in batches of four per thread ahead of their stores: interleaved, the compiler cannot
    // move a load above a store to memory it might alias, so a thread had one 16-byte load in
    // flight at a time; all of a unit's at D = 128 spilled the narrow kernel's registers.
    constexpr int kChunks = DP / 4, kPer = 64 * kChunks / 256;  // 16-byte chunks per row, per thread
    constexpr int kBatch = kPer < 4 ? kPer : 4;
    static_assert(kPer % kBatch == 0, "whole batches");
#pragma unroll 1
    for (int j0 = 0; j0 < kPer; j0 += kBatch) {
      float4 vs[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = tid + 256 * (j0 + j), r = i / kChunks, c = (i % kChunks) * 4;
        const int64_t n = n0 + r;
        vs[j] = n < seq ? __ldg(reinterpret_cast<const float4*>(src + n * x.ss + c)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = tid + 256 * (j0 + j), r = i / kChunks, c = (i % kChunks) * 4;
        const int64_t n = n0 + r;
        const float4 v = vs[j];
        if (n < seq) {
          if (dst != nullptr)
            *reinterpret_cast<float4*>(dst + n * DP + c) = tf32_big(v);
          if (kSplit && dsts != nullptr)
            *reinterpret_cast<float4*>(dsts + n * DP + c) = tf32_small(v);
        }
        tile[r][c] = v.x;
        tile[r][c + 1] = v.y;
        tile[r][c + 2] = v.z;
        tile[r][c + 3] = v.w;
      }
    }
  } else {
    for (int i = tid; i < 64 * DP; i += 256) {
      const int r = i / DP, c = i % DP;
      const int64_t n = n0 + r;
      const float v = n < seq && c < head_dim ? src[n * x.ss + c] : 0.0f;
      tile[r][c] = v;
      if (n < seq) {
        if (dst != nullptr) dst[n * DP + c] = tf32_big(v);
        if (kSplit && dsts != nullptr) dsts[n * DP + c] = tf32_small(v);
      }
    }
  }
  if (xt == nullptr) return;
  sync();
  float* dt = xt + bh * DP * seq8;
  float* dts = kSplit && xts != nullptr ? xts + bh * DP * seq8 : nullptr;
#pragma unroll 4
  for (int i = tid; i < 64 * DP; i += 256) {
    const int d = i / 64, r = i % 64;
    const int64_t col = n0 + tf32_slot(r);
    if (col < seq8) {
      const float v = tile[r][d];
      dt[d * seq8 + col] = tf32_big(v);
      if (kSplit && dts != nullptr) dts[d * seq8 + col] = tf32_small(v);
    }
  }
}

template <int DP, bool kVec, bool kSplit>
__global__ void __launch_bounds__(256) tf32_operand_kernel(In4 x, int64_t seq, int head_dim, int64_t seq8,
                                                           float* xr, float* xt, float* xs, float* xts) {
  __shared__ float tile[64][DP + 1];
  const int64_t b = blockIdx.z, h = blockIdx.y, bh = b * gridDim.y + h, n0 = static_cast<int64_t>(blockIdx.x) * 64;
  tf32_operand_unit<DP, kVec, kSplit>(x, b, h, bh, n0, seq, head_dim, seq8, xr, xt, xs, xts, tile,
                                      static_cast<int>(threadIdx.x), [] { __syncthreads(); });
}

// The same copies for up to two operands (Q and dO) by a few CTAs of kNarrowGroups x 256 threads,
// one per multiprocessor (the shared memory asked for keeps a second away), that run beside the dQ
// pass on the other multiprocessors (launch_tf32_operands_narrow). Each 256-thread group walks
// units (64 rows of one (b, h) of one operand) with its own tile: a few multiprocessors must keep
// many bytes moving. (Three groups, not four: at 1024 threads' 64 registers the batched loads
// spilled.)
constexpr int kNarrowGroups = 3;
// Unit u of a narrow kernel's walk (job 0's units, then job 1's): 64 rows from n0 (rows of them
// inside the sequence) of one (b, h) (bh = b * heads + h).
struct NarrowUnit {
  const OperandJob* o;
  int64_t b, h, bh, n0;
  int rows;
};
__device__ __forceinline__ NarrowUnit narrow_unit(const OperandJobs& J, int64_t units0, int64_t u) {
  const int j = u < units0 ? 0 : 1;
  const OperandJob& o = J.job[j];
  const int64_t v = u - (j ? units0 : 0), nx = (o.seq + 63) / 64, bh = v / nx, n0 = (v % nx) * 64;
  return NarrowUnit{&o, bh / o.heads, bh % o.heads, bh, n0, static_cast<int>(o.seq - n0 < 64 ? o.seq - n0 : 64)};
}
// The barrier of one 256-thread group (named barrier 1 + grp).
__device__ __forceinline__ void group_sync(int grp) { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + grp) : "memory"); }
// The staged rows of the sm_90 path (narrow_bulk): DP + 4 floats apart, so that every row starts
// 16-byte aligned (the bulk copy's rule) and the 8 rows a quarter-warp reads one float4 column of
// fall on 8 different 16-byte bank groups.
template <int DP>
constexpr int kNarrowRow = DP + 4;
template <int DP>
constexpr int narrow_bulk_smem() {
  return kNarrowGroups * (2 * 64 * kNarrowRow<DP> * 4 + 2 * 8);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The 16-byte path on sm_90: each group's next unit is read by the copy engine (64 row copies,
// cp.async.bulk, onto an mbarrier) into the second of two tiles while the group writes the current
// one out, so a unit's ~32 KiB of reads are always in flight: the loads of the plain path wait
// for the unit's stores to drain first, which held the kernel to ~31 GB/s per multiprocessor
// (measured: 777 us of 33 multiprocessors for the Q / dO copies at S = 1k).
template <int DP, bool kSplit>
__device__ __forceinline__ void narrow_bulk(const OperandJobs& J, int grp, int tid, float* smem) {
  constexpr int R = kNarrowRow<DP>, C4 = DP / 4;
  // Every group's two barriers first (16 bytes each group: the tiles stay 16-byte aligned), set up
  // by one thread before any group starts.
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + 2 * grp;
  float* tiles = smem + 4 * kNarrowGroups + grp * 2 * 64 * R;
  auto sync = [grp] { group_sync(grp); };
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2 * kNarrowGroups; ++i) mbar_init(reinterpret_cast<uint64_t*>(smem) + i, 1);
    mbar_init_fence();
  }
  __syncthreads();
  const int64_t units0 = J.job[0].units(), total = units0 + (J.n > 1 ? J.job[1].units() : 0);
  // Warp 0 of the group starts unit u's reads into tile t: one lane announces the bytes, the
  // lanes copy a row each. (The group's barrier before ordered every earlier access to the tile;
  // the fence orders them before the copy engine's writes.)
  auto issue = [&](int64_t u, int t) {
    const NarrowUnit w = narrow_unit(J, units0, u);
    const In4& x = w.o->x;
    const float* src = static_cast<const float*>(x.ptr) + w.b * x.sb + w.h * x.sh + w.n0 * x.ss;
    if (tid == 0) mbar_expect_tx(bars + t, static_cast<uint32_t>(w.rows) * DP * 4);
    __syncwarp();
    fence_proxy_async();
    for (int r = tid; r < w.rows; r += 32) bulk_copy_g2s(tiles + (t * 64 + r) * R, src + r * x.ss, DP * 4, bars + t);
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kNarrowGroups;
  int64_t u = static_cast<int64_t>(blockIdx.x) * kNarrowGroups + grp;
  if (u < total && tid < 32) issue(u, 0);
  for (int k = 0; u < total; u += stride, ++k) {
    // The next unit's reads go out first (its tile held unit k - 1, written out before the
    // group's last barrier).
    if (u + stride < total && tid < 32) issue(u + stride, (k + 1) & 1);
    const NarrowUnit w = narrow_unit(J, units0, u);
    const OperandJob& o = *w.o;
    float* tile = tiles + (k & 1) * 64 * R;
    mbar_wait(bars + (k & 1), (k >> 1) & 1);
    // Rows past the sequence: zeros, which the transposed copy writes up to S8.
    for (int i = tid; i < (64 - w.rows) * C4; i += 256)
      reinterpret_cast<float4*>(tile + (w.rows + i / C4) * R)[i % C4] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float* dst = o.xr != nullptr ? o.xr + (w.bh * o.seq + w.n0) * DP : nullptr;
    float* dsts = kSplit && o.xs != nullptr ? o.xs + (w.bh * o.seq + w.n0) * DP : nullptr;
    for (int i = tid; i < w.rows * C4; i += 256) {
      const int r = i / C4, c = i % C4;
      const float4 v = reinterpret_cast<const float4*>(tile + r * R)[c];
      if (dst != nullptr)
        reinterpret_cast<float4*>(dst + r * DP)[c] = tf32_big(v);
      if (kSplit && dsts != nullptr)
        reinterpret_cast<float4*>(dsts + r * DP)[c] = tf32_small(v);
    }
    if (o.xt != nullptr) {
      sync();  // the zeroed rows
      const int64_t seq8 = (o.seq + 7) / 8 * 8;
      float* dt = o.xt + w.bh * DP * seq8;
      float* dts = kSplit && o.xts != nullptr ? o.xts + w.bh * DP * seq8 : nullptr;
      // A warp: 32 rows (columns of the transposed copy: 128 coalesced bytes per store) of one
      // float4 column.
#pragma unroll 2
      for (int i = tid; i < 64 * C4; i += 256) {
        const int r = i % 64, d = (i / 64) * 4;
        const int64_t col = w.n0 + tf32_slot(r);
        if (col < seq8) {
          const float4 v = reinterpret_cast<const float4*>(tile + r * R)[d / 4];
          const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            dt[(d + q) * seq8 + col] = tf32_big(e[q]);
            if (kSplit && dts != nullptr) dts[(d + q) * seq8 + col] = tf32_small(e[q]);
          }
        }
      }
    }
    // The tile's last reads (and the zeroed rows' writes, made visible to the copy engine that
    // fills this tile again two units later: fence by the writers, then the barrier), before its
    // next unit's copies.
    if (w.rows < 64) fence_proxy_async();
    sync();
  }
}
#endif

template <int DP, bool kVec, bool kSplit>
__global__ void __launch_bounds__(kNarrowGroups * 256, 1) tf32_operand_narrow_kernel(const __grid_constant__ OperandJobs J) {
  extern __shared__ float4 smem4[];
  const int grp = static_cast<int>(threadIdx.x) / 256, tid = static_cast<int>(threadIdx.x) % 256;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kVec) {
    narrow_bulk<DP, kSplit>(J, grp, tid, reinterpret_cast<float*>(smem4));
    return;
  }
#endif
  float(*tile)[DP + 1] = reinterpret_cast<float(*)[DP + 1]>(smem4) + 64 * grp;
  auto sync = [grp] { group_sync(grp); };
  const int64_t units0 = J.job[0].units(), total = units0 + (J.n > 1 ? J.job[1].units() : 0);
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kNarrowGroups + grp; u < total;
       u += static_cast<int64_t>(gridDim.x) * kNarrowGroups) {
    const NarrowUnit w = narrow_unit(J, units0, u);
    const OperandJob& o = *w.o;
    tf32_operand_unit<DP, kVec, kSplit>(o.x, w.b, w.h, w.bh, w.n0, o.seq, J.head_dim, (o.seq + 7) / 8 * 8, o.xr, o.xt,
                                        o.xs, o.xts, tile, tid, sync);
    sync();  // the tile's last reads before the next unit's writes
  }
}

}  // namespace dev

namespace {
// The operand copies' checks and kernel choice, shared by both launchers: f(DP, kSplit, kVec) as
// integral constants for the padded head dim dp, whether any small part is written, and whether
// every operand takes the 16-byte path (D = DP, rows 16-byte aligned).
template <class F>
void with_operand_kernel(const OperandJob* jobs, int n, int64_t head_dim, int dp, F&& f) {
  bool vec = head_dim == dp, split = false;
  for (int j = 0; j < n; ++j) {
    const OperandJob& o = jobs[j];
    if (o.xts != nullptr && o.xt == nullptr)
      throw Error(Status::Internal, "cuda tf32 operands: a transposed small part needs the transposed copy");
    vec = vec && vec_ok(o.x, 4);
    split = split || o.xs != nullptr || o.xts != nullptr;
  }
  auto run_vec = [&](auto dpc, auto split_c) {
    if (vec) f(dpc, split_c, std::true_type{});
    else f(dpc, split_c, std::false_type{});
  };
  auto run_dp = [&](auto dpc) {
    if (split) run_vec(dpc, std::true_type{});
    else run_vec(dpc, std::false_type{});
  };
  switch (dp) {
    case 64: run_dp(std::integral_constant<int, 64>{}); break;
    case 128: run_dp(std::integral_constant<int, 128>{}); break;
    default: throw Error(Status::Internal, "cuda tf32 operands: unexpected padded head dim " + std::to_string(dp));
  }
}
}  // namespace

void launch_tf32_operands(const OperandJob& o, int64_t head_dim, int dp, cudaStream_t stream) {
  const dim3 grid(grid_blocks(o.seq, 64), static_cast<unsigned>(o.heads), static_cast<unsigned>(o.batch));
  const int64_t seq8 = (o.seq + 7) / 8 * 8;
  with_operand_kernel(&o, 1, head_dim, dp, [&](auto dpc, auto split_c, auto vec_c) {
    dev::tf32_operand_kernel<decltype(dpc)::value, decltype(vec_c)::value, decltype(split_c)::value>
        <<<grid, 256, 0, stream>>>(o.x, o.seq, static_cast<int>(head_dim), seq8, o.xr, o.xt, o.xs, o.xts);
  });
  check_launch("tf32 operand kernel launch");
}

void launch_tf32_operands_narrow(const OperandJobs& jobs, int dp, int ctas, cudaStream_t stream) {
  with_operand_kernel(jobs.job, jobs.n, jobs.head_dim, dp, [&](auto dpc, auto split_c, auto vec_c) {
    constexpr int DP = decltype(dpc)::value;
    // A tile per group (two on sm_90's 16-byte path, and its barriers), and at least 116 KiB:
    // with more than half of the multiprocessor's 227 KiB taken no second CTA lands on it, so
    // `ctas` CTAs hold `ctas` multiprocessors. (Launched by the sm_90 backward only.)
    constexpr int kThreads = dev::kNarrowGroups * 256;
    const int smem = std::max({dev::kNarrowGroups * 64 * (DP + 1) * 4, dev::narrow_bulk_smem<DP>(), 116 * 1024});
    launch_checked(dev::tf32_operand_narrow_kernel<DP, decltype(vec_c)::value, decltype(split_c)::value>, dim3(ctas),
                   kThreads, smem, stream, jobs, "tf32 operand (narrow) kernel launch");
  });
}

}  // namespace flashattn::cuda
