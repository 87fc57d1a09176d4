#include "core/backend.hpp"
namespace flashattn::cuda {
bool built() { return true; }
bool available() { return false; }
void forward(const ForwardParams&) { throw Error(Status::Unsupported, "cuda forward: not yet"); }
void backward(const BackwardParams&) { throw Error(Status::Unsupported, "cuda backward: not yet"); }
std::string describe() { return "placeholder"; }
void check_device_pointer(const void*, int32_t, const char*) {}
}  // namespace flashattn::cuda
