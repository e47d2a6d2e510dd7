// `shardtrain config`: prints the resolved run config (file + --set overrides + defaults), or the
// list of every key.
#include <iostream>

#include "shardtrain/cli/command.h"
#include "shardtrain/train/plan.h"

namespace shardtrain::cli {

Command config_command() {
  Command c;
  c.name = "config";
  c.summary = "print the resolved run config (every key, defaults included)";
  c.description =
      "Reads --config (required unless --keys), applies each --set, validates every key and\n"
      "prints the result as YAML that can be saved and passed back to --config. --keys lists\n"
      "every key instead.";
  c.flags = config_flags(/*config_required=*/false);
  c.flags.push_back(Flag("keys", "", "list every key with its type, default and help"));
  c.run = [](const Args& args) {
    if (args.has("keys")) {
      // The key list is the schema's, the same for every config: a --config or --set given
      // with it would be read by nothing (a typo in them would pass unnoticed).
      if (args.has("config") || args.has("set"))
        throw UsageError(
            "--keys lists every key of the schema and reads no config: give it alone, or drop "
            "--keys to resolve --config and --set");
      std::cout << train::describe_config_keys();
      return 0;
    }
    train::Config config = config_from_args(args);
    // What `train` would refuse before planning is refused here too.
    if (config.recipe == "auto") train::check_recipe_auto_settings(config);
    std::cout << "# resolved from " << args.get("config");
    for (const std::string& s : args.all("set")) std::cout << " --set " << s;
    if (config.recipe == "auto")
      std::cout << "\n# recipe: auto: train chooses the sharding, precision, activation strategy "
                   "and optimizer offload from the memory plan (`shardtrain plan` shows its "
                   "choice); the keys below are the defaults it starts from";
    std::cout << "\n" << config.to_yaml();
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
