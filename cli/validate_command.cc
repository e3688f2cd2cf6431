#include "cli/commands.h"
#include "cli/job_report.h"

namespace meshtrain::cli {

int ValidateCommand(const std::vector<std::string>& files, std::ostream& out) {
  int status = kExitOk;
  for (const std::string& file : files) {
    std::vector<api::CheckedJob> jobs;
    if (!LoadJobsOrReport(file, &jobs, out)) {
      status = kExitUnreadable;
      continue;
    }
    for (const api::CheckedJob& job : jobs) {
      if (job.ok()) {
        out << job.Where() << ": ok\n";
        PrintWarnings(job, out);
      } else {
        PrintErrors(job, out);
        if (status == kExitOk) status = kExitInvalid;
      }
    }
  }
  return status;
}

}  // namespace meshtrain::cli
