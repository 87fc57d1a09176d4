#include "args.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace flashattn::cli {

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void ArgParser::flag(const std::string& name, const std::string& metavar, const std::string& help,
                     std::function<void(const std::string&)> set,
                     std::vector<std::string> aliases) {
  Spec s;
  s.name = name;
  s.metavar = metavar;
  s.help = help;
  s.aliases = std::move(aliases);
  s.set = std::move(set);
  specs_.push_back(std::move(s));
}

void ArgParser::toggle(const std::string& name, const std::string& help, std::function<void()> set) {
  Spec s;
  s.name = name;
  s.help = help;
  s.takes_value = false;
  s.set = [set = std::move(set)](const std::string&) { set(); };
  specs_.push_back(std::move(s));
}

void ArgParser::section(const std::string& title) {
  Spec s;
  s.name = title;
  s.is_section = true;
  specs_.push_back(std::move(s));
}

void ArgParser::epilogue(const std::string& text) { epilogue_ = text; }

const ArgParser::Spec* ArgParser::find(const std::string& name) const {
  for (const Spec& s : specs_) {
    if (s.is_section) continue;
    if (s.name == name) return &s;
    for (const std::string& a : s.aliases)
      if (a == name) return &s;
  }
  return nullptr;
}

bool ArgParser::parse(int argc, char** argv, int first) {
  const std::string see = " (see '" + command_ + " --help')";
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    // Flags are long (--name) or short (-x, as aliases of long ones); both take their value as
    // the next argument or after '='. Anything else is a stray argument.
    const bool is_long = arg.size() > 2 && arg.compare(0, 2, "--") == 0;
    const bool is_short = arg.size() >= 2 && arg[0] == '-' && arg[1] != '-' &&
                          (arg.size() == 2 || arg[2] == '=');
    if (!is_long && !is_short) throw UsageError("unexpected argument '" + arg + "'" + see);
    std::string value;
    bool has_value = false;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    const Spec* s = find(arg);
    if (!s) throw UsageError("unknown flag '" + arg + "'" + see);
    if (!s->takes_value) {
      if (has_value) throw UsageError(arg + " takes no value, got '" + value + "'");
      s->set("");
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value (" + s->metavar + ")" + see);
      value = argv[++i];
    }
    try {
      s->set(value);
    } catch (const UsageError& e) {
      std::string msg = e.what();
      // Name the flag the way the user spelled it (an alias such as --seq for --seq-q).
      if (arg != s->name && msg.compare(0, s->name.size() + 1, s->name + ":") == 0)
        msg = arg + msg.substr(s->name.size());
      throw UsageError(msg + see);
    }
  }
  return true;
}

std::string ArgParser::help() const {
  std::ostringstream os;
  os << summary_ << "\n\nusage: " << command_ << " [flags]\n";
  constexpr size_t kColumn = 26;
  for (const Spec& s : specs_) {
    if (s.is_section) {
      os << "\n" << s.name << ":\n";
      continue;
    }
    std::string left = "  " + s.name;
    for (const std::string& a : s.aliases) left += ", " + a;
    if (s.takes_value) left += " " + s.metavar;
    // Help text may hold several lines; continuation lines line up under the first.
    std::string text = s.help;
    std::string indent(kColumn, ' ');
    for (size_t p = text.find('\n'); p != std::string::npos; p = text.find('\n', p + 1)) {
      text.insert(p + 1, indent);
      p += indent.size();
    }
    if (left.size() + 1 > kColumn)
      os << left << "\n" << indent << text << "\n";
    else
      os << left << std::string(kColumn - left.size(), ' ') << text << "\n";
  }
  if (!epilogue_.empty()) os << "\n" << epilogue_;
  if (epilogue_.empty() || epilogue_.back() != '\n') os << "\n";
  return os.str();
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min, int64_t max) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  // (strtoll would skip leading white space; a value is the whole argument or nothing)
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0' ||
      errno == ERANGE)
    throw UsageError(flag + ": expected an integer, got '" + text + "'");
  if (v < min || v > max)
    throw UsageError(flag + ": " + text + " is out of range [" + std::to_string(min) + ", " +
                     std::to_string(max) + "]");
  return v;
}

double parse_double(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0' ||
      errno == ERANGE || !std::isfinite(v))
    throw UsageError(flag + ": expected a finite number, got '" + text + "'");
  return v;
}

size_t parse_choice(const std::string& flag, const std::string& text,
                    const std::vector<std::string>& choices) {
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == text) return i;
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : "|") + c;
  throw UsageError(flag + ": expected one of " + list + ", got '" + text + "'");
}

}  // namespace flashattn::cli
