// flashattn: command-line front end of the library (check, bench, info).
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "args.hpp"
#include "commands.hpp"
#include "common.hpp"

namespace {

constexpr const char* kHelp =
    "flashattn - exact, memory-efficient attention (FlashAttention), forward and backward\n"
    "\n"
    "usage: flashattn <command> [flags]\n"
    "       flashattn <command> --help      flags of one command\n"
    "\n"
    "commands:\n"
    "  check   forward and backward on a random problem, every output (out, lse, dq, dk,\n"
    "          dv) compared with a float64 reference; fails beyond a per-dtype tolerance\n"
    "  bench   median time and GFLOP/s of forward, backward and both, peak extra memory,\n"
    "          and a naive O(S^2)-memory implementation side by side (CPU)\n"
    "  info    library version, backends, kernels, CPU features, CUDA devices\n"
    "\n"
    "check and bench share the problem flags: --batch --heads --kv-heads --seq (--seq-q)\n"
    "--seq-kv --head-dim --mask --window --softcap --alibi --dtype --layout --scale --seed,\n"
    "and --device (default: cuda:0 when usable, else cpu) --threads --precision.\n"
    "\n"
    "examples:\n"
    "  flashattn info\n"
    "  flashattn check --seq 1024 --heads 8 --head-dim 128 --mask causal\n"
    "  flashattn bench --seq 2048 --heads 8 --head-dim 128 --mask causal\n"
    "  flashattn check --dtype bfloat16 --layout bshd --heads 8 --kv-heads 2\n"
    "  flashattn bench --seq 2048 --mask causal_bottom_right --window 256,0 --softcap 30\n"
    "\n"
    "exit status: 0 ok, 1 check failed, 2 bad command line, 3 library or CUDA error,\n"
    "4 not supported by this build (Status::Unsupported, e.g. a backend not built)\n";

const char* status_label(flashattn::Status s) {
  return flashattn_status_string(static_cast<int>(s));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashattn::cli;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    std::fputs(kHelp, stdout);
    return kExitOk;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::printf("flashattn %s\n", flashattn_version());
    return kExitOk;
  }
  const std::string command = argv[1];
  const std::string prefix = "flashattn " + command + ": ";
  int rc = kExitOk;
  try {
    if (command == "check")
      rc = run_check(argc, argv, 2);
    else if (command == "bench")
      rc = run_bench(argc, argv, 2);
    else if (command == "info")
      rc = run_info(argc, argv, 2);
    else
      throw UsageError("unknown command '" + command + "' (commands: check, bench, info; see 'flashattn --help')");
  } catch (const UsageError& e) {
    Progress::global().finish();
    std::fprintf(stderr, "%s%s\n", command == "check" || command == "bench" || command == "info"
                                       ? prefix.c_str() : "flashattn: ",
                 e.what());
    return kExitUsage;
  } catch (const flashattn::Error& e) {
    Progress::global().finish();
    std::fprintf(stderr, "%serror (%s): %s\n", prefix.c_str(), status_label(e.status()), e.what());
    return e.status() == flashattn::Status::Unsupported ? kExitUnsupported : kExitError;
  } catch (const std::bad_alloc&) {
    Progress::global().finish();
    std::fprintf(stderr, "%serror: out of host memory (try a smaller shape)\n", prefix.c_str());
    return kExitError;
  } catch (const std::exception& e) {
    Progress::global().finish();
    std::fprintf(stderr, "%serror: %s\n", prefix.c_str(), e.what());
    return kExitError;
  }
  Progress::global().finish();
  return rc;
}
