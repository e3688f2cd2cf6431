// Environment variables of the worker contract and of meshtrain's tuning knobs
// (MESHTRAIN_*, and the torchrun names). Errors name the variable and its value.
// Thread-safe as far as getenv is (nothing may setenv concurrently).

#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace meshtrain::api {

// The value, or `fallback` when the variable is unset or empty.
std::string EnvironmentString(const char* name, const std::string& fallback = "");

// The value as an integer in [minimum, maximum]; `fallback` when unset or empty.
// Throws std::runtime_error: "the worker environment lacks NAME" when unset without a
// fallback, or "NAME="x" is not an integer in [minimum, maximum]".
int64_t EnvironmentInteger(const char* name, int64_t minimum, int64_t maximum,
                           std::optional<int64_t> fallback = std::nullopt);

// A required rank, node index or count of the worker contract: an integer in
// [minimum, 2^20]. Throws as EnvironmentInteger does.
int EnvironmentRank(const char* name, int minimum);

// Writes `reason` (as worker::FailureReasonLine makes it) to the file
// MESHTRAIN_FAILURE_FILE names, replacing what was there: a failing rank's last word to its
// launcher (api/worker_contract.h). Does nothing when the variable is unset, and nothing
// more when the file cannot be written.
void WriteFailureReason(const std::string& reason);

// The running program's own file (/proc/self/exe); empty when it cannot be read. For
// finding the programs and plugins installed or built beside it.
std::filesystem::path ThisProgram();

}  // namespace meshtrain::api
