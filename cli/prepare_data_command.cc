#include "cli/commands.h"
#include "worker/train/token_file.h"

namespace meshtrain::cli {

int PrepareDataCommand(const PrepareDataOptions& options, std::ostream& out) {
  try {
    const train::TokenSplit split =
        train::WriteTextAsTokenFiles(options.input, options.output, options.validation, options.validation_fraction);
    out << options.output << ": " << split.train << " tokens\n";
    if (!options.validation.empty()) out << options.validation << ": " << split.validation << " tokens\n";
  } catch (const train::TokenFileError& e) {
    out << e.what() << "\n";
    return kExitUnreadable;
  }
  return kExitOk;
}

}  // namespace meshtrain::cli
