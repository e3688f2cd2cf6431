#include "cli/commands.h"
#include "cli/job_report.h"

namespace meshtrain::cli {

int LayoutCommand(const std::string& file, std::ostream& out) {
  std::vector<api::CheckedJob> jobs;
  if (!LoadJobsOrReport(file, &jobs, out)) return kExitUnreadable;
  int status = kExitOk;
  for (const api::CheckedJob& job : jobs) {
    if (!job.ok()) {
      PrintErrors(job, out);
      status = kExitInvalid;
      continue;
    }
    PrintWarnings(job, out);
    PrintLayout(job, /*groups=*/true, out);
  }
  return status;
}

}  // namespace meshtrain::cli
