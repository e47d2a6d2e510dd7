// What a subcommand is made of: its flags, its help, and the function that runs it.
//
// A subcommand lives in its own file in src/cli/ as a function returning a Command, listed once in
// the registry in src/cli/cli.cpp. Flags are `--name VALUE` or `--name=VALUE`; switches are
// `--name`; `-h`/`--help` is handled for every command.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/train/config.h"

namespace shardtrain::cli {

// A command-line mistake (unknown subcommand or flag, missing value); exits with code 2.
class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

struct Command;

// One flag of a command, written as e.g.
//   Flag("output", "FILE.h5", "where to write the dataset").mandatory()
//   Flag("keys", "", "list every key")            (a switch: no value)
struct Flag {
  std::string name;        // without dashes: "config"
  std::string value_name;  // shown in help, "FILE"; empty = a switch that takes no value
  std::string help;        // one line
  bool required = false;
  bool repeatable = false;
  std::string default_value;  // what Args::get() returns when the flag is absent ("" = none)

  Flag(std::string name, std::string value_name, std::string help)
      : name(std::move(name)), value_name(std::move(value_name)), help(std::move(help)) {}
  Flag& mandatory() { return required = true, *this; }
  Flag& repeated() { return repeatable = true, *this; }
  Flag& defaults_to(std::string value) { return default_value = std::move(value), *this; }
};

// The parsed flags of one invocation.
class Args {
 public:
  bool has(const std::string& name) const;
  // The flag's value (the last one if repeated), else its default.
  std::string get(const std::string& name) const;
  // Every value of a repeatable flag, in order.
  std::vector<std::string> all(const std::string& name) const;
  // get() read as a whole number; throws UsageError naming the flag otherwise.
  long long get_int(const std::string& name) const;
  // get() read as a finite number that is positive (or, with zero_allowed, not negative); throws
  // UsageError naming the flag and `expected` (what the number means) otherwise.
  double get_number(const std::string& name, bool zero_allowed, const std::string& expected) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  friend Args parse_args(const Command& command, const std::vector<std::string>& args);
  std::map<std::string, std::vector<std::string>> values_;
  std::map<std::string, std::string> defaults_;
  std::vector<std::string> positional_;
};

struct Command {
  std::string name;         // "prepare-data"
  std::string summary;      // one line for `shardtrain --help`
  std::string description;  // more detail for `shardtrain NAME --help`; may be empty
  std::vector<Flag> flags;
  std::string positional;  // help name of positional arguments ("FILE..."); "" = none accepted
  std::function<int(const Args&)> run;  // returns the exit code
};

// Parses the arguments after the subcommand name. Throws UsageError for an unknown flag (naming
// the closest known one), a missing value, a repeated single flag, a missing required flag or an
// unexpected positional argument.
Args parse_args(const Command& command, const std::vector<std::string>& args);

// `shardtrain NAME --help`: usage line, description and one line per flag.
std::string command_help(const Command& command);

// The flags of every command that reads a run config: --config FILE and repeatable --set K=V.
// `config_required`: the command cannot run without --config (usage shows it so).
std::vector<Flag> config_flags(bool config_required = true);
// Loads --config with the --set overrides applied, and warns (rank 0) of keys set but never read,
// except those of `varied_sections` ("activation", ...): sections whose keys the command sets
// itself, row by row (bench, plan), so that the base config's settings may count there.
train::Config config_from_args(const Args& args,
                               const std::vector<std::string>& varied_sections = {});

// Every subcommand, in the order `shardtrain --help` lists them.
const std::vector<Command>& commands();

}  // namespace shardtrain::cli
