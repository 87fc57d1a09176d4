// A small command-line parser: named flags (`--name value`, `--name=value`), switches, and a
// generated --help. Every mistake throws UsageError, which main() turns into exit status 2.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashattn::cli {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ArgParser {
 public:
  // `command` is what the user typed ("flashattn check"); `summary` opens the help text.
  ArgParser(std::string command, std::string summary);

  // A flag taking a value. `set` parses the text and throws UsageError when it is wrong.
  // `aliases` are extra spellings ("--seq" for "--seq-q").
  void flag(const std::string& name, const std::string& metavar, const std::string& help,
            std::function<void(const std::string&)> set, std::vector<std::string> aliases = {});
  // A flag without a value.
  void toggle(const std::string& name, const std::string& help, std::function<void()> set);
  // A heading printed before the flags added after it.
  void section(const std::string& title);
  // Free text printed after the flags (examples, notes).
  void epilogue(const std::string& text);

  // Parses argv[first..argc). Returns false when --help/-h was given (help already printed).
  bool parse(int argc, char** argv, int first);
  std::string help() const;

 private:
  struct Spec {
    std::string name, metavar, help;
    std::vector<std::string> aliases;
    std::function<void(const std::string&)> set;
    bool takes_value = true;
    bool is_section = false;
  };
  const Spec* find(const std::string& name) const;
  std::string command_, summary_, epilogue_;
  std::vector<Spec> specs_;
};

// Value parsers; `flag` names the flag in the error message.
int64_t parse_int(const std::string& flag, const std::string& text, int64_t min, int64_t max);
double parse_double(const std::string& flag, const std::string& text);
// Index of `text` in `choices` (exact match), or UsageError listing them.
size_t parse_choice(const std::string& flag, const std::string& text,
                    const std::vector<std::string>& choices);

}  // namespace flashattn::cli
