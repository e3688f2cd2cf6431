#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "api/logging.h"
#include "cli/commands.h"

namespace meshtrain::cli {

namespace {

std::string VersionString() {
#ifdef MESHTRAIN_HAVE_CUDA
  constexpr const char* cuda = "on";
#else
  constexpr const char* cuda = "off";
#endif
  return std::string("meshtrain ") + MESHTRAIN_VERSION + " (cuda " + cuda + ")";
}

}  // namespace

int Main(int argc, char** argv) {
  CLI::App app{"meshtrain: train large models across GPU clusters, or on this machine", "meshtrain"};
  app.set_version_flag("--version", VersionString());
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "Log level")
      ->check(CLI::IsMember(LogLevelNames()))
      ->capture_default_str();

  std::vector<std::string> files;
  CLI::App* validate = app.add_subcommand("validate", "Check TrainingJob manifests; print ok or each error with its field path");
  validate->add_option("files", files, "Manifest files (YAML or JSON)")->required();

  std::string file;
  CLI::App* layout = app.add_subcommand("layout", "Print a job's mesh: which ranks form each TP, shard and replica group");
  layout->add_option("file", file, "Manifest file")->required();

  CLI::App* run = app.add_subcommand("run", "Run a job on this machine");
  run->add_option("file", file, "Manifest file with one TrainingJob")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUnreadable;
  }
  InitLogging("meshtrain", log_level);

  if (*validate) return ValidateCommand(files, std::cout);
  if (*layout) return LayoutCommand(file, std::cout);
  if (*run) return RunCommand(file, std::cout);
  return kExitUnreadable;
}

}  // namespace meshtrain::cli
