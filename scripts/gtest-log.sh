# Sourced by the GPU scripts (gpu-check, gpu-ab16): reading a GoogleTest log.
# gtest_counts LOG: "PASSED n / FAILED n / SKIPPED n" lines of a GoogleTest log, on one line.
gtest_counts() { grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$1" | tr '\n' ' '; }
# no_tests LOG: true when the filter matched nothing (a silent pass otherwise).
no_tests() { grep -qE '^\[==========\] 0 tests? from' "$1"; }
