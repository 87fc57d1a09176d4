/* Prints what the C compiler makes of include/flashattn/flashattn.h: struct sizes, field offsets
 * and sizes, and every #define, one "name value" pair per line, for tests/layout.rs to compare
 * with the hand-written Rust declarations. */
#include <stddef.h>
#include <stdio.h>

#include "flashattn/flashattn.h"

#define SIZE(T) printf("sizeof(%s) %lld\n", #T, (long long)sizeof(T))
#define ALIGN(T) printf("alignof(%s) %lld\n", #T, (long long)_Alignof(T))
#define FIELD(T, f)                                                           \
  printf("offsetof(%s.%s) %lld\n", #T, #f, (long long)offsetof(T, f));        \
  printf("sizeof(%s.%s) %lld\n", #T, #f, (long long)sizeof(((T*)0)->f))
#define DEF(name) printf("%s %lld\n", #name, (long long)(name))

int main(void) {
  SIZE(flashattn_tensor);
  ALIGN(flashattn_tensor);
  FIELD(flashattn_tensor, data);
  FIELD(flashattn_tensor, dtype);
  FIELD(flashattn_tensor, device);
  FIELD(flashattn_tensor, ndim);
  FIELD(flashattn_tensor, shape);
  FIELD(flashattn_tensor, stride);

  SIZE(flashattn_options);
  ALIGN(flashattn_options);
  FIELD(flashattn_options, struct_size);
  FIELD(flashattn_options, softmax_scale);
  FIELD(flashattn_options, mask);
  FIELD(flashattn_options, stream);
  FIELD(flashattn_options, num_threads);
  FIELD(flashattn_options, precision);
  FIELD(flashattn_options, deterministic);
  FIELD(flashattn_options, reserved0);
  FIELD(flashattn_options, window_left);
  FIELD(flashattn_options, window_right);
  FIELD(flashattn_options, softcap);
  FIELD(flashattn_options, sliding_window);
  FIELD(flashattn_options, alibi_slopes);
  FIELD(flashattn_options, max_flops);
  FIELD(flashattn_options, cancel);
  FIELD(flashattn_options, cancel_arg);
  FIELD(flashattn_options, workspace);
  FIELD(flashattn_options, workspace_bytes);
  FIELD(flashattn_options, workspace_query);

  SIZE(flashattn_varlen);
  FIELD(flashattn_varlen, struct_size);
  FIELD(flashattn_varlen, cu_seqlens_q);
  FIELD(flashattn_varlen, cu_seqlens_k);
  FIELD(flashattn_varlen, seqused_k);
  FIELD(flashattn_varlen, max_seqlen_q);
  FIELD(flashattn_varlen, max_seqlen_k);

  SIZE(flashattn_kvcache);
  ALIGN(flashattn_kvcache);
  FIELD(flashattn_kvcache, struct_size);
  FIELD(flashattn_kvcache, k_new);
  FIELD(flashattn_kvcache, v_new);
  FIELD(flashattn_kvcache, cache_seqlens);
  FIELD(flashattn_kvcache, cache_batch_idx);
  FIELD(flashattn_kvcache, cache_leftpad);
  FIELD(flashattn_kvcache, block_table);
  FIELD(flashattn_kvcache, rotary_cos);
  FIELD(flashattn_kvcache, rotary_sin);
  FIELD(flashattn_kvcache, rotary_interleaved);
  FIELD(flashattn_kvcache, num_splits);

  SIZE(int);

  DEF(FLASHATTN_VERSION_MAJOR);
  DEF(FLASHATTN_VERSION_MINOR);
  DEF(FLASHATTN_VERSION_PATCH);
  DEF(FLASHATTN_FLOAT32);
  DEF(FLASHATTN_FLOAT16);
  DEF(FLASHATTN_BFLOAT16);
  DEF(FLASHATTN_FLOAT64);
  DEF(FLASHATTN_INT32);
  DEF(FLASHATTN_CPU);
  DEF(FLASHATTN_MASK_NONE);
  DEF(FLASHATTN_MASK_CAUSAL_TOP_LEFT);
  DEF(FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT);
  DEF(FLASHATTN_PRECISION_FP32);
  DEF(FLASHATTN_PRECISION_TF32);
  DEF(FLASHATTN_OK);
  DEF(FLASHATTN_ERROR_INVALID_ARGUMENT);
  DEF(FLASHATTN_ERROR_UNSUPPORTED);
  DEF(FLASHATTN_ERROR_BACKEND);
  DEF(FLASHATTN_ERROR_OUT_OF_MEMORY);
  DEF(FLASHATTN_ERROR_INTERNAL);
  DEF(FLASHATTN_ERROR_CANCELLED);
  DEF(FLASHATTN_OPTIONS_V1_SIZE);
  DEF(FLASHATTN_OPTIONS_V2_SIZE);
  DEF(FLASHATTN_OPTIONS_V3_SIZE);
  DEF(FLASHATTN_OPTIONS_V4_SIZE);
  DEF(FLASHATTN_MAX_THREADS);
  DEF(FLASHATTN_MAX_SOFTMAX_SCALE);
  return 0;
}
