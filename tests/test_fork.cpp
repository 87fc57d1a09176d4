// A process that forks after using the CPU backend (a Python DataLoader worker, a pre-forking
// server) must be able to use it in the child: the pool's worker threads do not exist there.
// Before the pool handled fork, the child waited forever for workers that never ran.
#include <gtest/gtest.h>

#include <csignal>
#include <cstring>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

TEST(CpuFork, ChildUsesTheBackendAfterTheParentDid) {
  const ProblemConfig cfg =
      make_config(1, 4, 2, 200, 300, 64, Mask::CausalBottomRight, DType::Float32,
                  testing::Layout::BHSD, 0.0f, /*seed=*/5);
  const Options opts = options_for(cfg, /*num_threads=*/2);
  Problem parent(cfg);
  run_forward(parent, opts);  // starts the pool's worker threads in the parent
  run_backward(parent, opts);
  const Snapshot want = snapshot(parent);

  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // Child: a hang ends in SIGALRM, a wrong answer in exit code 1; no gtest machinery here.
    close(pipefd[0]);
    alarm(60);
    int code = 0;
    try {
      Problem child(cfg);
      run_forward(child, opts);
      run_backward(child, opts);
      code = snapshot(child) == want ? 0 : 1;
    } catch (...) {
      code = 2;
    }
    const char byte = static_cast<char>(code);
    (void)!write(pipefd[1], &byte, 1);
    _exit(code);
  }
  close(pipefd[1]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  char byte = -1;
  const ssize_t got = read(pipefd[0], &byte, 1);
  close(pipefd[0]);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child died of signal " << WTERMSIG(status)
                                    << (WTERMSIG(status) == SIGALRM ? " (it hung)" : "");
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(got, 1);
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "exit 1: the child's results differ from the parent's; 2: it threw";
}

}  // namespace
}  // namespace flashattn::test
