// KV-cache calls on the CPU: the append and the rotated q (kvcache.cpp).
#pragma once

#include "core/params.hpp"

namespace flashattn::cpu {

// Writes k_new / v_new into the caches (kp.s_new > 0; keys rotated when kp.rotary.cos is set)
// and, when q_rot is given (rotary calls: B * Hq * Sq * D elements of the call's dtype), q rotated
// into it. Returns the q operand the attention reads: q_rot's contiguous view, or p.fwd.q.
In4 kvcache_prepare(const KvcacheParams& kp, void* q_rot);

}  // namespace flashattn::cpu
