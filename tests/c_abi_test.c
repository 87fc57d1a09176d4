/*
 * The C ABI driven from C (compiled as C99, pedantic): flashattn.h must be a valid C header, and a
 * forward + backward through it must agree with a naive attention written here in plain C.
 * Exit status 0 on success; every failed check prints a line and makes it 1.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn/flashattn.h"

static int failures = 0;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      ++failures;                                               \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                             \
      fputc('\n', stderr);                                      \
    }                                                           \
  } while (0)

enum { B = 2, HQ = 4, HKV = 2, SQ = 6, SKV = 5, D = 8 };
#define NQ (B * HQ * SQ * D)
#define NK (B * HKV * SKV * D)
#define NL (B * HQ * SQ)

static float q[NQ], k[NK], v[NK], out[NQ], dout[NQ], dq[NQ], dk[NK], dv[NK], lse[NL];

static flashattn_tensor view4(float* data, int64_t h, int64_t s) {
  flashattn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = FLASHATTN_FLOAT32;
  t.device = FLASHATTN_CPU;
  t.ndim = 4;
  t.shape[0] = B;
  t.shape[1] = h;
  t.shape[2] = s;
  t.shape[3] = D;
  t.stride[3] = 1;
  t.stride[2] = D;
  t.stride[1] = s * D;
  t.stride[0] = h * s * D;
  return t;
}

static flashattn_tensor view_lse(float* data) {
  flashattn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = FLASHATTN_FLOAT32;
  t.device = FLASHATTN_CPU;
  t.ndim = 3;
  t.shape[0] = B;
  t.shape[1] = HQ;
  t.shape[2] = SQ;
  t.stride[2] = 1;
  t.stride[1] = SQ;
  t.stride[0] = HQ * SQ;
  return t;
}

/* Deterministic inputs in [-1.5, 1.5). */
static void fill(float* x, int n, unsigned seed) {
  unsigned s = seed;
  int i;
  for (i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)((double)(s >> 8) / 16777216.0 * 3.0 - 1.5);
  }
}

static void poison(void) {
  int i;
  for (i = 0; i < NQ; ++i) out[i] = dq[i] = NAN;
  for (i = 0; i < NK; ++i) dk[i] = dv[i] = NAN;
  for (i = 0; i < NL; ++i) lse[i] = NAN;
}

/* The score modifications of the naive attention: a sliding window (-1 = unbounded side), a
   softcap (0 = none) and ALiBi slopes per (b, h) at slopes[b * HQ + h] (NULL = none). */
static long g_left = -1, g_right = -1;
static double g_softcap = 0;
static const float* g_slopes = NULL;

static int visible(int mask, int i, int j) {
  if (g_left >= 0 && j < i + SKV - SQ - g_left) return 0;
  if (g_right >= 0 && j > i + SKV - SQ + g_right) return 0;
  if (mask == FLASHATTN_MASK_CAUSAL_TOP_LEFT) return j <= i;
  if (mask == FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT) return j <= i + SKV - SQ;
  return 1;
}

/* Naive attention in double with explicit P: forward and the gradients of sum(out * dout). */
static double r_out[NQ], r_lse[NL], r_dq[NQ], r_dk[NK], r_dv[NK];

static void naive(int mask, double scale) {
  int b, h, i, j, x;
  memset(r_dk, 0, sizeof r_dk);
  memset(r_dv, 0, sizeof r_dv);
  for (b = 0; b < B; ++b)
    for (h = 0; h < HQ; ++h) {
      const int hk = h / (HQ / HKV);
      const float* Q = q + (b * HQ + h) * SQ * D;
      const float* K = k + (b * HKV + hk) * SKV * D;
      const float* V = v + (b * HKV + hk) * SKV * D;
      const float* dO = dout + (b * HQ + h) * SQ * D;
      double P[SQ][SKV], dP[SQ][SKV], F[SQ][SKV];
      const double slope = g_slopes ? (double)g_slopes[b * HQ + h] : 0.0;
      for (i = 0; i < SQ; ++i) {
        double m = -INFINITY, sum = 0, rowdot = 0;
        double s[SKV];
        const int row = (b * HQ + h) * SQ + i;
        for (j = 0; j < SKV; ++j) {
          double acc = 0, t;
          for (x = 0; x < D; ++x) acc += (double)Q[i * D + x] * K[j * D + x];
          s[j] = scale * acc;
          F[i][j] = 1.0;
          if (g_softcap > 0) {
            t = tanh(s[j] / g_softcap);
            s[j] = g_softcap * t;
            F[i][j] = 1.0 - t * t;
          }
          s[j] -= slope * fabs((double)(i + SKV - SQ - j));
          if (!visible(mask, i, j)) s[j] = -INFINITY;
          if (s[j] > m) m = s[j];
        }
        for (j = 0; j < SKV; ++j) sum += visible(mask, i, j) ? exp(s[j] - m) : 0.0;
        r_lse[row] = sum > 0 ? m + log(sum) : -INFINITY;
        for (j = 0; j < SKV; ++j) P[i][j] = sum > 0 && visible(mask, i, j) ? exp(s[j] - m) / sum : 0.0;
        for (x = 0; x < D; ++x) {
          double acc = 0;
          for (j = 0; j < SKV; ++j) acc += P[i][j] * V[j * D + x];
          r_out[row * D + x] = acc;
        }
        for (j = 0; j < SKV; ++j) {
          double acc = 0;
          for (x = 0; x < D; ++x) acc += (double)dO[i * D + x] * V[j * D + x];
          dP[i][j] = acc;
          rowdot += P[i][j] * acc;
        }
        for (j = 0; j < SKV; ++j) dP[i][j] = P[i][j] * (dP[i][j] - rowdot) * F[i][j]; /* dS o F */
        for (x = 0; x < D; ++x) {
          double acc = 0;
          for (j = 0; j < SKV; ++j) acc += dP[i][j] * K[j * D + x];
          r_dq[row * D + x] = scale * acc;
        }
      }
      for (j = 0; j < SKV; ++j)
        for (x = 0; x < D; ++x) {
          double a_k = 0, a_v = 0;
          for (i = 0; i < SQ; ++i) {
            a_k += dP[i][j] * Q[i * D + x];
            a_v += P[i][j] * dO[i * D + x];
          }
          r_dk[((b * HKV + hk) * SKV + j) * D + x] += scale * a_k;
          r_dv[((b * HKV + hk) * SKV + j) * D + x] += a_v;
        }
    }
}

/* max |got - ref| / max |ref| over finite refs; -inf must match -inf; NaN fails. */
static double rel_err(const float* got, const double* ref, int n, const char* name) {
  double max_abs = 0, max_ref = 0;
  int i;
  for (i = 0; i < n; ++i) {
    if (isinf(ref[i])) {
      CHECK(got[i] == ref[i], "%s[%d] = %g, expected %g", name, i, got[i], ref[i]);
      continue;
    }
    CHECK(isfinite(got[i]), "%s[%d] = %g is not finite", name, i, got[i]);
    if (fabs(got[i] - ref[i]) > max_abs) max_abs = fabs(got[i] - ref[i]);
    if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
  }
  return max_abs / (max_ref > 0 ? max_ref : 1);
}

/* KV-cache decode from C: q [B, 1, HQ, D], caches [B, SC, HKV, D], one new key per sequence
   appended at cache_seqlens[b]; the naive result attends rows [0, cache_seqlens[b]] (no mask). */
enum { SC = 8 };
#define NC (B * SC * HKV * D)
static float kq[B * HQ * D], kc[NC], vc[NC], kn[B * HKV * D], vn[B * HKV * D], ko[B * HQ * D], kl[B * HQ];

static flashattn_tensor bshd(float* data, int64_t b, int64_t s, int64_t h) {
  flashattn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = FLASHATTN_FLOAT32;
  t.device = FLASHATTN_CPU;
  t.ndim = 4;
  t.shape[0] = b;
  t.shape[1] = s;
  t.shape[2] = h;
  t.shape[3] = D;
  t.stride[3] = 1;
  t.stride[2] = D;
  t.stride[1] = h * D;
  t.stride[0] = s * h * D;
  return t;
}

static void kvcache_checks(void) {
  static int32_t seqlens[B] = {3, 6};
  static float kc0[NC], vc0[NC];
  flashattn_tensor tq = bshd(kq, B, 1, HQ), tkc = bshd(kc, B, SC, HKV), tvc = bshd(vc, B, SC, HKV);
  flashattn_tensor tkn = bshd(kn, B, 1, HKV), tvn = bshd(vn, B, 1, HKV), to = bshd(ko, B, 1, HQ), tl, tsl;
  flashattn_kvcache kv;
  int st, b, h, j, x, i;
  double err = 0, ref_max = 0;
  memset(&tl, 0, sizeof tl);
  tl.data = kl;
  tl.dtype = FLASHATTN_FLOAT32;
  tl.device = FLASHATTN_CPU;
  tl.ndim = 3;
  tl.shape[0] = B, tl.shape[1] = HQ, tl.shape[2] = 1;
  tl.stride[0] = HQ, tl.stride[1] = 1, tl.stride[2] = 1;
  memset(&tsl, 0, sizeof tsl);
  tsl.data = seqlens;
  tsl.dtype = FLASHATTN_INT32;
  tsl.device = FLASHATTN_CPU;
  tsl.ndim = 1;
  tsl.shape[0] = B;
  tsl.stride[0] = 1;
  fill(kq, B * HQ * D, 11);
  fill(kc, NC, 12);
  fill(vc, NC, 13);
  fill(kn, B * HKV * D, 14);
  fill(vn, B * HKV * D, 15);
  memcpy(kc0, kc, sizeof kc);
  memcpy(vc0, vc, sizeof vc);
  for (i = 0; i < B * HQ * D; ++i) ko[i] = NAN;

  memset(&kv, 0x5a, sizeof kv);
  flashattn_kvcache_init(&kv);
  CHECK(kv.struct_size == sizeof(flashattn_kvcache) && kv.rotary_interleaved == 1 && kv.num_splits == 0 &&
            kv.k_new == NULL && kv.block_table == NULL && kv.rotary_cos == NULL,
        "kvcache_init left a non-default field");
  kv.k_new = &tkn;
  kv.v_new = &tvn;
  kv.cache_seqlens = &tsl;

  /* a struct smaller than this header's, NULL, or num_splits out of range: refused, nothing written */
  kv.struct_size = (uint32_t)offsetof(flashattn_kvcache, rotary_interleaved);
  st = flashattn_forward_kvcache(&tq, &tkc, &tvc, &to, &tl, &kv, NULL);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "kv struct_size too small: status %d", st);
  CHECK(strstr(flashattn_last_error(), "kv->struct_size") != NULL, "message: '%s'", flashattn_last_error());
  kv.struct_size = sizeof(flashattn_kvcache);
  kv.num_splits = 129;
  st = flashattn_forward_kvcache(&tq, &tkc, &tvc, &to, &tl, &kv, NULL);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT && strstr(flashattn_last_error(), "num_splits = 129") != NULL,
        "num_splits = 129: status %d, '%s'", st, flashattn_last_error());
  kv.num_splits = -1;
  st = flashattn_forward_kvcache(&tq, &tkc, &tvc, &to, &tl, &kv, NULL);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT && strstr(flashattn_last_error(), "num_splits = -1") != NULL,
        "num_splits = -1: status %d, '%s'", st, flashattn_last_error());
  kv.num_splits = 0;
  st = flashattn_forward_kvcache(&tq, &tkc, &tvc, &to, &tl, NULL, NULL);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT && strstr(flashattn_last_error(), "kv is NULL") != NULL,
        "NULL kv: status %d, '%s'", st, flashattn_last_error());
  CHECK(memcmp(kc, kc0, sizeof kc) == 0 && memcmp(vc, vc0, sizeof vc) == 0, "a refused call wrote the cache");
  for (i = 0; i < B * HQ * D; ++i) CHECK(isnan(ko[i]), "out[%d] written by a failed call", i);

  st = flashattn_forward_kvcache(&tq, &tkc, &tvc, &to, &tl, &kv, NULL);
  CHECK(st == FLASHATTN_OK, "forward_kvcache: %s", flashattn_last_error());
  for (b = 0; b < B; ++b)
    for (j = 0; j < SC; ++j)
      for (h = 0; h < HKV; ++h) {
        const int o = ((b * SC + j) * HKV + h) * D;
        const float* want_k = j == seqlens[b] ? &kn[(b * HKV + h) * D] : &kc0[o];
        const float* want_v = j == seqlens[b] ? &vn[(b * HKV + h) * D] : &vc0[o];
        CHECK(memcmp(&kc[o], want_k, D * sizeof(float)) == 0 && memcmp(&vc[o], want_v, D * sizeof(float)) == 0,
              "cache row %d of sequence %d", j, b);
      }
  for (b = 0; b < B; ++b)
    for (h = 0; h < HQ; ++h) {
      const int hk = h / (HQ / HKV), n = seqlens[b] + 1;
      const double scale = (double)(float)(1.0 / sqrt((double)D));
      double sc[SC], m = -INFINITY, sum = 0, lse_ref;
      for (j = 0; j < n; ++j) {
        double a = 0;
        for (x = 0; x < D; ++x) a += (double)kq[(b * HQ + h) * D + x] * kc[((b * SC + j) * HKV + hk) * D + x];
        sc[j] = a * scale;
        if (sc[j] > m) m = sc[j];
      }
      for (j = 0; j < n; ++j) sum += exp(sc[j] - m);
      lse_ref = m + log(sum);
      err = fmax(err, fabs(kl[b * HQ + h] - lse_ref) / fabs(lse_ref));
      for (x = 0; x < D; ++x) {
        double o = 0;
        for (j = 0; j < n; ++j) o += exp(sc[j] - lse_ref) * vc[((b * SC + j) * HKV + hk) * D + x];
        err = fmax(err, fabs(ko[(b * HQ + h) * D + x] - o));
        ref_max = fmax(ref_max, fabs(o));
      }
    }
  CHECK(err < 1e-5 * (ref_max > 1 ? ref_max : 1), "kvcache: error %g", err);
}

int main(void) {
  const flashattn_tensor tq = view4(q, HQ, SQ), tk = view4(k, HKV, SKV), tv = view4(v, HKV, SKV);
  const flashattn_tensor tout = view4(out, HQ, SQ), tdout = view4(dout, HQ, SQ);
  const flashattn_tensor tdq = view4(dq, HQ, SQ), tdk = view4(dk, HKV, SKV), tdv = view4(dv, HKV, SKV);
  const flashattn_tensor tlse = view_lse(lse);
  flashattn_options opts;
  int masks[] = {FLASHATTN_MASK_NONE, FLASHATTN_MASK_CAUSAL_TOP_LEFT, FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT};
  int m, st, i;

  fill(q, NQ, 1);
  fill(k, NK, 2);
  fill(v, NK, 3);
  fill(dout, NQ, 4);

  /* options_init: struct_size = sizeof, everything else zero / NULL */
  memset(&opts, 0x5a, sizeof opts);
  flashattn_options_init(&opts);
  CHECK(opts.struct_size == sizeof(flashattn_options), "struct_size = %u", opts.struct_size);
  CHECK(opts.softmax_scale == 0.0f && opts.mask == 0 && opts.stream == NULL &&
            opts.num_threads == 0 && opts.precision == 0 && opts.deterministic == 0,
        "options_init left a non-default field");

  for (m = 0; m < 3; ++m) {
    double e;
    poison();
    flashattn_options_init(&opts);
    opts.mask = masks[m];
    opts.softmax_scale = m == 1 ? 0.25f : 0.0f;
    st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
    CHECK(st == FLASHATTN_OK, "forward mask %d: %s: %s", masks[m], flashattn_status_string(st),
          flashattn_last_error());
    CHECK(strcmp(flashattn_last_error(), "") == 0, "last_error after success: '%s'",
          flashattn_last_error());
    st = flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, &opts);
    CHECK(st == FLASHATTN_OK, "backward mask %d: %s: %s", masks[m], flashattn_status_string(st),
          flashattn_last_error());
    naive(masks[m], m == 1 ? (double)0.25f : (double)(float)(1.0 / sqrt((double)D)));
    /* float32 accumulation over at most 8 terms per sum: errors are ~1e-7 relative */
    e = rel_err(out, r_out, NQ, "out");
    CHECK(e < 1e-5, "mask %d: out relative error %g", masks[m], e);
    e = rel_err(lse, r_lse, NL, "lse");
    CHECK(e < 1e-5, "mask %d: lse relative error %g", masks[m], e);
    e = rel_err(dq, r_dq, NQ, "dq");
    CHECK(e < 1e-5, "mask %d: dq relative error %g", masks[m], e);
    e = rel_err(dk, r_dk, NK, "dk");
    CHECK(e < 1e-5, "mask %d: dk relative error %g", masks[m], e);
    e = rel_err(dv, r_dv, NK, "dv");
    CHECK(e < 1e-5, "mask %d: dv relative error %g", masks[m], e);
  }
  /* bottom-right with Sq = 6 > Skv = 5: row 0 of every head sees no key */
  for (i = 0; i < B * HQ; ++i) {
    CHECK(isinf(lse[i * SQ]) && lse[i * SQ] < 0, "lse of masked row = %g", lse[i * SQ]);
    CHECK(out[i * SQ * D] == 0.0f && dq[i * SQ * D] == 0.0f, "masked row not zero");
  }

  /* deterministic = 1, and the structs of older callers (version 1, and the one before
     `deterministic` was appended), each in a heap block of exactly its size: accepted, and bitwise
     the results of the default options (the CPU backward is deterministic whatever the flag) */
  {
    static float w_out[NQ], w_lse[NL], w_dq[NQ], w_dk[NK], w_dv[NK];
    const size_t sizes[] = {sizeof(flashattn_options), offsetof(flashattn_options, deterministic),
                            FLASHATTN_OPTIONS_V1_SIZE};
    int s;
    poison();
    flashattn_options_init(&opts);
    opts.mask = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
    st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
    st |= flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, &opts);
    CHECK(st == FLASHATTN_OK, "default options: %s", flashattn_last_error());
    memcpy(w_out, out, sizeof out);
    memcpy(w_lse, lse, sizeof lse);
    memcpy(w_dq, dq, sizeof dq);
    memcpy(w_dk, dk, sizeof dk);
    memcpy(w_dv, dv, sizeof dv);
    opts.deterministic = 1;
    for (s = 0; s < 3; ++s) {
      flashattn_options* o = (flashattn_options*)malloc(sizes[s]);
      CHECK(o != NULL, "malloc(%u)", (unsigned)sizes[s]);
      if (o == NULL) continue;
      memcpy(o, &opts, sizes[s]);
      o->struct_size = (uint32_t)sizes[s];
      poison();
      st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, o);
      CHECK(st == FLASHATTN_OK, "struct_size %u forward: %s", (unsigned)sizes[s],
            flashattn_last_error());
      st = flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, o);
      CHECK(st == FLASHATTN_OK, "struct_size %u backward: %s", (unsigned)sizes[s],
            flashattn_last_error());
      CHECK(memcmp(w_out, out, sizeof out) == 0 && memcmp(w_lse, lse, sizeof lse) == 0 &&
                memcmp(w_dq, dq, sizeof dq) == 0 && memcmp(w_dk, dk, sizeof dk) == 0 &&
                memcmp(w_dv, dv, sizeof dv) == 0,
            "struct_size %u: results differ from the default options'", (unsigned)sizes[s]);
      free(o);
    }
  }

  /* sliding window, softcap and ALiBi ([B, Hq] slopes, zero and negative ones included) */
  {
    static float slopes[B * HQ] = {0.5f, 0.0f, -0.125f, 0.25f, 1.0f, 0.0625f, 0.0f, -0.5f};
    flashattn_tensor ts;
    double e;
    static float w_out[NQ], w_dq[NQ];
    memset(&ts, 0, sizeof ts);
    ts.data = slopes;
    ts.dtype = FLASHATTN_FLOAT32;
    ts.device = FLASHATTN_CPU;
    ts.ndim = 2;
    ts.shape[0] = B;
    ts.shape[1] = HQ;
    ts.stride[0] = HQ;
    ts.stride[1] = 1;
    for (m = 0; m < 3; ++m) {
      poison();
      flashattn_options_init(&opts);
      opts.mask = masks[m];
      opts.sliding_window = 1;
      opts.window_left = 1;
      opts.window_right = m == 0 ? 2 : -1;
      opts.softcap = 3.0f;
      opts.alibi_slopes = &ts;
      st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
      st |= flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, &opts);
      CHECK(st == FLASHATTN_OK, "mods, mask %d: %s", masks[m], flashattn_last_error());
      g_left = 1;
      g_right = m == 0 ? 2 : -1;
      g_softcap = (double)3.0f;
      g_slopes = slopes;
      naive(masks[m], (double)(float)(1.0 / sqrt((double)D)));
      e = rel_err(out, r_out, NQ, "out");
      CHECK(e < 1e-5, "mods, mask %d: out relative error %g", masks[m], e);
      e = rel_err(lse, r_lse, NL, "lse");
      CHECK(e < 1e-5, "mods, mask %d: lse relative error %g", masks[m], e);
      e = rel_err(dq, r_dq, NQ, "dq");
      CHECK(e < 1e-5, "mods, mask %d: dq relative error %g", masks[m], e);
      e = rel_err(dk, r_dk, NK, "dk");
      CHECK(e < 1e-5, "mods, mask %d: dk relative error %g", masks[m], e);
      e = rel_err(dv, r_dv, NK, "dv");
      CHECK(e < 1e-5, "mods, mask %d: dv relative error %g", masks[m], e);
      g_left = g_right = -1;
      g_softcap = 0;
      g_slopes = NULL;
    }

    /* a version-2 caller's struct (40 bytes, in a heap block of exactly that size) has none of
       them: the results are the plain call's, bitwise */
    {
      flashattn_options* o2 = (flashattn_options*)malloc(FLASHATTN_OPTIONS_V2_SIZE);
      CHECK(o2 != NULL, "malloc(%u)", FLASHATTN_OPTIONS_V2_SIZE);
      poison();
      flashattn_options_init(&opts);
      opts.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
      st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
      st |= flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, &opts);
      CHECK(st == FLASHATTN_OK, "plain: %s", flashattn_last_error());
      memcpy(w_out, out, sizeof out);
      memcpy(w_dq, dq, sizeof dq);
      if (o2 != NULL) {
        opts.sliding_window = 1;
        opts.window_left = -5; /* invalid if read */
        opts.softcap = -1.0f;  /* invalid if read */
        opts.alibi_slopes = &ts;
        opts.struct_size = FLASHATTN_OPTIONS_V2_SIZE;
        memcpy(o2, &opts, FLASHATTN_OPTIONS_V2_SIZE);
        poison();
        st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, o2);
        st |= flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, o2);
        CHECK(st == FLASHATTN_OK, "struct_size 40: %s", flashattn_last_error());
        CHECK(memcmp(w_out, out, sizeof out) == 0 && memcmp(w_dq, dq, sizeof dq) == 0,
              "struct_size 40: results differ from the plain call's");
        free(o2);
      }
    }

    /* sliding_window = 0: window_left / window_right are not read */
    poison();
    flashattn_options_init(&opts);
    opts.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
    opts.window_left = -3;
    opts.window_right = -3;
    st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
    CHECK(st == FLASHATTN_OK, "sliding_window = 0 with bad sizes: %s", flashattn_last_error());
    CHECK(memcmp(w_out, out, sizeof out) == 0, "sliding_window = 0: out differs from the plain call's");

    /* a bad softcap: refused, named, nothing written */
    poison();
    flashattn_options_init(&opts);
    opts.softcap = -2.0f;
    st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
    CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "softcap -2: status %d", st);
    CHECK(strstr(flashattn_last_error(), "options.softcap = -2") != NULL, "message: '%s'",
          flashattn_last_error());
    for (i = 0; i < NQ; ++i) CHECK(isnan(out[i]), "out[%d] written by a failed call", i);
  }

  /* NULL options: the defaults (no mask, 1/sqrt(D)) */
  poison();
  st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, NULL);
  CHECK(st == FLASHATTN_OK, "forward with NULL opts: %s", flashattn_last_error());
  naive(FLASHATTN_MASK_NONE, (double)(float)(1.0 / sqrt((double)D)));
  CHECK(rel_err(out, r_out, NQ, "out") < 1e-5, "NULL opts: out differs from mask none");

  /* failures: a status, a message naming the argument, nothing written */
  poison();
  flashattn_options_init(&opts);
  opts.mask = 3;
  st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, &opts);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "unknown mask: status %d", st);
  CHECK(strstr(flashattn_last_error(), "options.mask = 3") != NULL, "message: '%s'",
        flashattn_last_error());
  for (i = 0; i < NQ; ++i) CHECK(isnan(out[i]), "out[%d] written by a failed call", i);

  st = flashattn_forward(NULL, &tk, &tv, &tout, &tlse, NULL);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "NULL q: status %d", st);
  CHECK(strstr(flashattn_last_error(), "q is NULL") != NULL, "message: '%s'", flashattn_last_error());

  flashattn_options_init(&opts);
  opts.struct_size = 8;
  st = flashattn_backward(&tq, &tk, &tv, &tout, &tdout, &tlse, &tdq, &tdk, &tdv, &opts);
  CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "struct_size 8: status %d", st);
  CHECK(strstr(flashattn_last_error(), "struct_size = 8") != NULL, "message: '%s'",
        flashattn_last_error());

  {
    flashattn_tensor bad = tk;
    bad.shape[3] = 4;
    st = flashattn_forward(&tq, &bad, &tv, &tout, &tlse, NULL);
    CHECK(st == FLASHATTN_ERROR_INVALID_ARGUMENT, "k head_dim 4: status %d", st);
    CHECK(strstr(flashattn_last_error(), "k.shape[3] (head_dim) = 4") != NULL, "message: '%s'",
          flashattn_last_error());
  }

  /* success clears the message again */
  st = flashattn_forward(&tq, &tk, &tv, &tout, &tlse, NULL);
  CHECK(st == FLASHATTN_OK && flashattn_last_error()[0] == '\0', "last_error not cleared: '%s'",
        flashattn_last_error());

  CHECK(strcmp(flashattn_status_string(FLASHATTN_OK), "ok") == 0, "status string 0");
  CHECK(strcmp(flashattn_status_string(FLASHATTN_ERROR_INVALID_ARGUMENT), "invalid argument") == 0,
        "status string 1");
  CHECK(strcmp(flashattn_status_string(FLASHATTN_ERROR_UNSUPPORTED), "unsupported") == 0,
        "status string 2");
  CHECK(strcmp(flashattn_status_string(99), "unknown status") == 0, "status string 99");
  CHECK(flashattn_version() != NULL && strchr(flashattn_version(), '.') != NULL, "version");

  kvcache_checks();

  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("c_abi_test: all checks passed\n");
  return failures ? 1 : 0;
}
