// Test bodies that may crash or hang, run in a forked child: the GPU-free tests of thread
// exhaustion (tests/test_thread_pool.cpp, tests/test_limits.cpp) use it so that a hang becomes a
// failure after an alarm instead of stalling the suite.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

namespace flashattn::test {

// Runs body() in a forked child that must exit 0 within `seconds`. body returns "" on success or
// a description of what went wrong, which the child sends back through a pipe.
inline ::testing::AssertionResult in_child(const std::function<std::string()>& body, int seconds = 20) {
  int fds[2];
  if (pipe(fds) != 0) return ::testing::AssertionFailure() << "pipe: " << std::strerror(errno);
  const pid_t pid = fork();
  if (pid < 0) return ::testing::AssertionFailure() << "fork: " << std::strerror(errno);
  if (pid == 0) {
    close(fds[0]);
    alarm(static_cast<unsigned>(seconds));
    std::string msg;
    try {
      msg = body();
    } catch (const std::exception& e) {
      msg = std::string("threw: ") + e.what();
    } catch (...) {
      msg = "threw a non-std exception";
    }
    (void)!write(fds[1], msg.data(), msg.size());
    _exit(msg.empty() ? 0 : 1);
  }
  close(fds[1]);
  std::string msg;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return ::testing::AssertionFailure() << "waitpid failed";
  if (WIFSIGNALED(status))
    return ::testing::AssertionFailure()
           << "the child died of signal " << WTERMSIG(status)
           << (WTERMSIG(status) == SIGALRM ? " (it hung: alarm after " + std::to_string(seconds) + " s)"
                                           : std::string(WTERMSIG(status) == SIGABRT ? " (abort / std::terminate)" : ""));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return ::testing::AssertionFailure() << "the child failed: " << msg;
  return ::testing::AssertionSuccess();
}

}  // namespace flashattn::test
