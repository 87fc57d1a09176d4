// The CUDA backend's stand-in for builds without CUDA (FLASHATTN_CUDA=OFF or no nvcc).
#include "core/backend.hpp"

namespace flashattn::cuda {

namespace {
[[noreturn]] void not_built() {
  throw Error(Status::Unsupported, "this build of flashattn has no CUDA backend");
}
}  // namespace

bool built() { return false; }
bool available() { return false; }
void forward(const ForwardParams&) { not_built(); }
void backward(const BackwardParams&) { not_built(); }
void forward_kvcache(const KvcacheParams&) { not_built(); }
uint64_t forward_workspace(const ForwardParams&) { not_built(); }
uint64_t backward_workspace(const BackwardParams&) { not_built(); }
uint64_t kvcache_workspace(const KvcacheParams&) { not_built(); }
std::string describe() { return "not built"; }
void set_override(const char*, const char*) { not_built(); }
void check_device_pointer(const void*, int32_t device, const char* what) {
  if (device >= 0) not_built();
  (void)what;
}
void copy_to_host(void*, const void*, size_t, int32_t, void*) { not_built(); }
bool kv_checks_on_device() { return false; }
int64_t take_check_failures(int32_t) { not_built(); }

}  // namespace flashattn::cuda
