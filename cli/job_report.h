// Shared pieces of the commands' reports.

#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "api/manifest.h"

namespace meshtrain::cli {

// Loads `file`; on a read or syntax error prints it and returns false.
bool LoadJobsOrReport(const std::string& file, std::vector<api::CheckedJob>* jobs, std::ostream& out);

// Loads a file that must hold exactly one valid TrainingJob into *job. Returns kExitOk,
// or prints why not and returns the exit code for it. `command` names the caller in messages.
int LoadOneValidJob(const std::string& file, const std::string& command, api::CheckedJob* job, std::ostream& out);

// Prints each error of an invalid job as "<where>: <path>: <message>".
void PrintErrors(const api::CheckedJob& job, std::ostream& out);

// Prints each warning of a valid job as "<where>: warning: <path>: <message>".
void PrintWarnings(const api::CheckedJob& job, std::ostream& out);

// Prints the (P x) R x S x T mesh of a valid job, with pipeline stages each stage's ranks,
// blocks and modelled memory, and the values derived for fields it left out; with
// `groups`, every group's members too.
void PrintLayout(const api::CheckedJob& job, bool groups, std::ostream& out);

}  // namespace meshtrain::cli
