#include "core/backend.hpp"
namespace flashattn::cpu {
void forward(const ForwardParams&) { throw Error(Status::Unsupported, "cpu forward: not yet"); }
void backward(const BackwardParams&) { throw Error(Status::Unsupported, "cpu backward: not yet"); }
std::string describe() { return "placeholder"; }
}  // namespace flashattn::cpu
