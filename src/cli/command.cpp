#include "shardtrain/cli/command.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iostream>
#include <optional>

#include "shardtrain/core/suggest.h"
#include "shardtrain/dist/env.h"

namespace shardtrain::cli {

bool Args::has(const std::string& name) const {
  return values_.count(name) > 0;
}

std::string Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second.back();
  auto d = defaults_.find(name);
  return d == defaults_.end() ? "" : d->second;
}

std::vector<std::string> Args::all(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

long long Args::get_int(const std::string& name) const {
  std::string text = get(name);
  long long v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty())
    throw UsageError("--" + name + " " + text + ": expected a whole number");
  return v;
}

double Args::get_number(const std::string& name, bool zero_allowed,
                        const std::string& expected) const {
  const std::string text = get(name);
  double v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool whole = ec == std::errc() && end == text.data() + text.size() && !text.empty();
  // Not a number is a usage error (2); a number out of range is a bad value (1), as for
  // integer flags.
  if (!whole) throw UsageError("--" + name + " " + text + ": expected " + expected);
  if (!std::isfinite(v) || v < 0 || (v == 0 && !zero_allowed))
    throw ConfigError("--" + name + " " + text + ": expected " + expected);
  return v;
}

namespace {

const Flag* find_flag(const Command& command, const std::string& name) {
  for (const Flag& f : command.flags)
    if (f.name == name) return &f;
  return nullptr;
}

[[noreturn]] void unknown_flag(const Command& command, const std::string& given) {
  std::vector<std::string> names;
  for (const Flag& f : command.flags) names.push_back("--" + f.name);
  std::string message = "unknown flag '" + given + "' for 'shardtrain " + command.name + "'";
  std::string near = closest_match(given, names);
  if (!near.empty()) message += ": did you mean '" + near + "'?";
  throw UsageError(message);
}

}  // namespace

Args parse_args(const Command& command, const std::vector<std::string>& args) {
  Args parsed;
  for (const Flag& f : command.flags)
    if (!f.default_value.empty()) parsed.defaults_[f.name] = f.default_value;

  bool flags_done = false;  // after "--" everything is positional
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    bool looks_like_flag = !flags_done && arg.size() > 1 && arg[0] == '-';
    if (!flags_done && arg == "--") {
      flags_done = true;
      continue;
    }
    if (!looks_like_flag) {
      if (command.positional.empty())
        throw UsageError("'shardtrain " + command.name + "' takes no argument '" + arg +
                         "' (flags start with --)");
      parsed.positional_.push_back(arg);
      continue;
    }
    if (arg.rfind("--", 0) != 0) unknown_flag(command, arg);

    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const Flag* flag = find_flag(command, name);
    if (!flag) unknown_flag(command, "--" + name);

    std::string value;
    if (flag->value_name.empty()) {
      if (inline_value)
        throw UsageError("--" + name +
                         " is a switch and takes no value (remove '=" + *inline_value + "')");
      value = "true";
    } else if (inline_value) {
      value = *inline_value;
    } else {
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
        throw UsageError("--" + name + " needs a value: --" + name + " " + flag->value_name);
      value = args[++i];
    }
    auto& values = parsed.values_[name];
    if (!values.empty() && !flag->repeatable)
      throw UsageError("--" + name + " is given more than once (" + values.back() + ", " + value +
                       "); give it once");
    values.push_back(value);
  }

  for (const Flag& f : command.flags)
    if (f.required && !parsed.has(f.name))
      throw UsageError("'shardtrain " + command.name + "' needs --" + f.name + " " + f.value_name);
  return parsed;
}

std::string command_help(const Command& command) {
  std::string usage = "usage: shardtrain " + command.name;
  for (const Flag& f : command.flags) {
    std::string text = "--" + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    if (f.repeatable) text += " ...";
    usage += f.required ? " " + text : " [" + text + "]";
  }
  if (!command.positional.empty()) usage += " " + command.positional;

  std::string out = usage + "\n\n" + command.summary + "\n";
  if (!command.description.empty()) out += "\n" + command.description + "\n";

  std::vector<std::pair<std::string, std::string>> rows;
  for (const Flag& f : command.flags) {
    std::string help = f.help;
    if (f.required) help += " (required)";
    if (f.repeatable) help += " (repeatable)";
    if (!f.default_value.empty()) help += " (default: " + f.default_value + ")";
    rows.push_back({"--" + f.name + (f.value_name.empty() ? "" : " " + f.value_name), help});
  }
  rows.push_back({"-h, --help", "show this help"});
  size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  out += "\nflags:\n";
  for (const auto& [left, right] : rows)
    out += "  " + left + std::string(width - left.size() + 2, ' ') + right + "\n";
  return out;
}

std::vector<Flag> config_flags(bool config_required) {
  Flag config("config", "FILE", "run config (YAML), e.g. configs/tiny.yaml");
  if (config_required) config.mandatory();
  return {
      config,
      Flag("set", "KEY=VALUE", "override one config key, e.g. --set optim.lr=1e-3").repeated(),
  };
}

train::Config config_from_args(const Args& args, const std::vector<std::string>& varied_sections) {
  if (!args.has("config"))
    throw UsageError("a run config is needed: --config FILE (e.g. --config configs/tiny.yaml)");
  // A --set without '=' is a malformed command line (exit 2), not a bad setting.
  for (const std::string& set : args.all("set"))
    if (set.find('=') == std::string::npos)
      throw UsageError("--set " + set + ": expected KEY=VALUE, e.g. --set optim.lr=1e-3");
  train::Config config = train::load_config(args.get("config"), args.all("set"));
  // Under mpirun every rank reads the same config: one copy of each warning is enough.
  if (dist::job_rank() == 0)
    for (const std::string& line : config.unused_settings()) {
      // A command that sets a section's keys per row (bench, plan) decides what counts there.
      const bool varied =
          std::any_of(varied_sections.begin(), varied_sections.end(),
                      [&](const std::string& v) { return line.rfind(v + ".", 0) == 0; });
      if (!varied) std::cerr << "warning: " << line << "\n";
    }
  return config;
}

}  // namespace shardtrain::cli
