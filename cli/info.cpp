// `flashattn info`: what this build and this machine offer.
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "commands.hpp"
#include "common.hpp"
#include "device.hpp"

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace flashattn::cli {
namespace {

std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "model name", 10) == 0 || std::strncmp(line, "Model", 5) == 0) {
      const char* colon = std::strchr(line, ':');
      if (colon) {
        model = colon + 1;
        model.erase(0, model.find_first_not_of(" \t"));
        model.erase(model.find_last_not_of(" \t\n") + 1);
      }
      break;
    }
  }
  std::fclose(f);
  return model;
}

// The instruction-set extensions a vectorised kernel may dispatch on, as this CPU reports them.
std::string cpu_features() {
  std::string s;
  auto add = [&s](const char* name, bool on) {
    if (on) s += std::string(s.empty() ? "" : " ") + name;
  };
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  add("sse4.2", __builtin_cpu_supports("sse4.2"));
  add("avx", __builtin_cpu_supports("avx"));
  add("avx2", __builtin_cpu_supports("avx2"));
  add("fma", __builtin_cpu_supports("fma"));
  add("f16c", __builtin_cpu_supports("f16c"));
  add("avx512f", __builtin_cpu_supports("avx512f"));
  add("avx512bw", __builtin_cpu_supports("avx512bw"));
  add("avx512vl", __builtin_cpu_supports("avx512vl"));
  add("avx512dq", __builtin_cpu_supports("avx512dq"));
  add("avx512bf16", __builtin_cpu_supports("avx512bf16"));
#elif defined(__aarch64__)
  add("neon", true);
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP);
#ifdef HWCAP_ASIMDHP
  add("fp16", hw & HWCAP_ASIMDHP);
#endif
#ifdef HWCAP_SVE
  add("sve", hw & HWCAP_SVE);
#endif
#endif
#endif
  return s.empty() ? "none detected" : s;
}

}  // namespace

int run_info(int argc, char** argv, int first) {
  ArgParser parser("flashattn info",
                   "flashattn info: the library's version and backends (with the kernels and\n"
                   "instruction set the CPU backend chose), this CPU's features, and the CUDA\n"
                   "devices this tool can see.");
  if (!parser.parse(argc, argv, first)) return kExitOk;
  std::ostringstream os;
  os << build_info();
  os << "cuda usable: " << (cuda_available() ? "yes" : "no") << "\n";
  os << "cpu: " << cpu_model() << ", " << std::thread::hardware_concurrency()
     << " hardware threads\n";
  os << "cpu features: " << cpu_features() << "\n";
  os << "tool: built " << (cli_built_with_cuda() ? "with" : "without") << " CUDA; devices:\n";
  for (const std::string& l : cuda_device_lines()) os << "  " << l << "\n";
  emit(os.str());
  return kExitOk;
}

}  // namespace flashattn::cli
