// The subcommands. Each parses argv[first..argc) itself and returns the process exit status;
// UsageError, flashattn::Error and std::bad_alloc propagate to main(), which maps them to exit codes.
#pragma once

namespace flashattn::cli {

int run_check(int argc, char** argv, int first);
int run_bench(int argc, char** argv, int first);
int run_info(int argc, char** argv, int first);

}  // namespace flashattn::cli
