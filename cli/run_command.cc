#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "cli/job_report.h"

namespace meshtrain::cli {

int RunCommand(const std::string& file, std::ostream& out) {
  std::vector<api::CheckedJob> jobs;
  if (!LoadJobsOrReport(file, &jobs, out)) return kExitUnreadable;
  if (jobs.size() != 1) {
    out << file << ": holds " << jobs.size() << " documents; meshtrain run takes a file with one TrainingJob\n";
    return kExitInvalid;
  }
  const api::CheckedJob& job = jobs.front();
  if (!job.ok()) {
    PrintErrors(job, out);
    return kExitInvalid;
  }
  out << job.Where() << ": ok\n";
  PrintLayout(job, /*groups=*/false, out);
  spdlog::warn("this build has no training engine yet: the job was validated and laid out, not trained");
  return kExitOk;
}

}  // namespace meshtrain::cli
