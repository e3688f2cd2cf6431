// The `meshtrain` subcommands. Each writes its report to `out` and returns the
// process exit code: 0 success, 1 an invalid job, 2 a file that cannot be read or parsed.

#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace meshtrain::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalid = 1;
inline constexpr int kExitUnreadable = 2;

// Prints "ok" or every error, with its field path, for each job in each file.
int ValidateCommand(const std::vector<std::string>& files, std::ostream& out);

// Prints the mesh of each job in `file`: nodes, and the TP, shard and replica groups.
int LayoutCommand(const std::string& file, std::ostream& out);

// Runs one job on this machine. Until the worker engine lands it validates the
// job and prints its layout.
int RunCommand(const std::string& file, std::ostream& out);

// The whole CLI: parses argv and dispatches.
int Main(int argc, char** argv);

}  // namespace meshtrain::cli
