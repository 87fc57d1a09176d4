// Developer overrides of the CUDA backend's kernel selection: one struct, read once.
//
// The defaults (select.cpp) are what the library measured fastest; these knobs exist so that tests
// can run every kernel variant on one GPU and benchmarks can compare the alternatives. They are
// compiled in only with the CMake option FLASHATTN_DEV_OVERRIDES (on in test and benchmark builds,
// off in the Python package and any build that sets it off): a release library has no knobs.
//
// | variable                        | values                       | effect                                              |
// | ------------------------------- | ---------------------------- | --------------------------------------------------- |
// | FLASHATTN_CUDA_ARCH             | sm80, sm90                   | sm80: a 9.0 device runs the mma.sync kernels        |
// | FLASHATTN_CUDA_MATH             | fma, tf32, 3xtf32            | float32 arithmetic instead of the precision's       |
// | FLASHATTN_CUDA_BWD              | split, atomic, ordered       | 16-bit backward design (deterministic forces split  |
// |                                 |                              | unless ordered: sm_90a atomic, dQ in key order)     |
// | FLASHATTN_CUDA_SM90_VARIANT     | 0, 1                         | 16-bit sm_90a dK/dV CTA shape (1: D = 64 only)      |
// | FLASHATTN_CUDA_PINGPONG         | 0, 1                         | 16-bit sm_90a forward warpgroup ping-pong           |
// | FLASHATTN_CUDA_TF32_FWD_COPIES  | none, v, kv                  | tf32 sm_90a forward: operands the pre-pass copies   |
// | FLASHATTN_CUDA_FP32_FWD         | mma, wgmma                   | fp32 (3xTF32) forward family on 9.0                 |
// | FLASHATTN_CUDA_TF32_BWD         | mma, wgmma-dq, wgmma, pair   | tf32 backward on 9.0 (wgmma-dq: dK/dV on mma.sync)  |
// | FLASHATTN_CUDA_FP32_BWD         | mma, wgmma                   | fp32 (3xTF32) backward family on 9.0                |
// | FLASHATTN_CUDA_PERSISTENT_CTAS  | N, sms (0: one per block)    | CTAs of the sm_90a float32 pair kernels             |
// | FLASHATTN_CUDA_CONVERT_CTAS     | N (0: no side stream)        | CTAs copying Q/dO beside the float32 dQ pass        |
// | FLASHATTN_CUDA_FWD_CTAS         | N, sms (0: one per block)    | CTAs walking the 16-bit sm_90a forward's row blocks |
// |                                 |                              | (dense calls; default: sms where blocks cost alike) |
// | FLASHATTN_CUDA_PACKED_GRID      | dense, compact               | packed 16-bit sm_90a forward: CTAs per real block   |
// | FLASHATTN_CUDA_KEY_CHUNK        | N (multiple of 128, 0: none) | keys per chunk of the fp32-mode forward (16384)     |
// | FLASHATTN_CUDA_DECODE_LOADER    | bulk, rows, generic          | KV-cache kernel's K/V loads (DecodeShape::Loader;   |
// |                                 |                              | bulk: sm_90, 16-byte rows, D = DP; else rows)       |
// | FLASHATTN_CUDA_DECODE_STAGES    | 2, 3, 4                      | KV-cache kernel's K/V pipeline stages (fewer where  |
// |                                 |                              | shared memory does not hold them)                   |
// | FLASHATTN_CUDA_KV_CHECK         | host, device                 | KV-cache index arrays in device memory: read and    |
// |                                 |                              | checked on the host, or on the stream (the default) |
// | FLASHATTN_CUDA_DECODE_STREAMS   | 1, 2, 3, 4                   | whole-tile KV CTAs per SM the split rule aims at    |
// |                                 |                              | (default: kv_streams, from the memory bandwidth)    |
// | FLASHATTN_CUDA_ORD_HEADS        | 0, 1                         | ordered 16-bit backward under GQA: a CTA per query  |
// |                                 |                              | head (1, BackwardPlan::dkv_acc) or per kv head (0)  |
// | FLASHATTN_CUDA_ATOMIC_HEADS     | 0, 1                         | the default 16-bit sm_90a backward under GQA: a CTA |
// |                                 |                              | per query head, dK/dV summed in head order (1)      |
//
// The environment is read at the first call that selects a kernel; set_override() (and the C
// symbol flashattn_dev_set_override, for tests and benchmarks in other languages) changes one knob
// for the rest of the process. A value that is not in the table is an InvalidArgument naming the
// variable and the choices, at the first call.
#pragma once

#include <string>

namespace flashattn::cuda {

// Each field: -1 = no override (the library's choice); otherwise the index of the value in the
// table's list (ARCH: 0 sm80, 1 sm90; MATH: a Math; BWD: 0 split, 1 atomic; ...), or a count.
struct Overrides {
  int arch = -1;
  int math = -1;
  int bwd = -1;
  int sm90_variant = -1;
  int pingpong = -1;
  int tf32_fwd_copies = -1;
  int fp32_fwd = -1;
  int tf32_bwd = -1;
  int fp32_bwd = -1;
  long persistent_ctas = -1;  // -2: "sms" (one per multiprocessor)
  long convert_ctas = -1;
  long fwd_ctas = -1;  // -2: "sms"
  int packed_grid = -1;  // 1: compact (the packed sm_90a forward's grid of real row blocks)
  long key_chunk = -1;   // keys per chunk of the float32 fp32-mode forward (0: never chunked)
  int decode_loader = -1;  // a DecodeShape::Loader: 0 bulk, 1 rows, 2 generic
  int decode_stages = -1;  // 0, 1, 2: 2, 3, 4 stages
  int kv_check = -1;       // 0 host, 1 device
  int decode_streams = -1; // 1..4: CTAs per SM for the whole-tile loader's split rule (kv_streams)
  int ord_heads = -1;      // the ordered backward's head split under GQA: 0 never, 1 always (dense calls)
  int atomic_heads = -1;   // the default 16-bit sm_90a backward's head split under GQA: 1 always (dense calls)
};

// Whether this build has the knobs (FLASHATTN_DEV_OVERRIDES).
bool overrides_enabled();
// The process's overrides (all -1 in a build without the knobs). Thread-safe; reads the
// environment once.
Overrides overrides();
// Sets knob `name` (a variable of the table) to `value` (nullptr or "": no override). Throws
// InvalidArgument for an unknown name or value, or Unsupported in a build without the knobs.
void set_override(const char* name, const char* value);
// Parses the variables of the table from `getenv_fn`-style lookups (for unit tests).
Overrides parse_overrides(const char* (*lookup)(const char* name, void* ctx), void* ctx);

}  // namespace flashattn::cuda
