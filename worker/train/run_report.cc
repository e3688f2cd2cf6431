#include "worker/train/run_report.h"

namespace meshtrain::train {

RunReport::RunReport(std::ostream& out, const Trainer& trainer, runtime::Device device)
    : out_(out), trainer_(trainer), device_(device) {}

void RunReport::Started() {
  for (const std::string& w : trainer_.checkpoint_warnings()) out_ << "warning: " << w << "\n";
  if (const std::optional<int64_t> step = trainer_.resumed_from()) {
    out_ << "resumed from step " << *step << " (" << trainer_.resumed_directory() << ")\n";
    if (*step >= trainer_.steps()) {
      out_ << "the job is already complete at step " << *step << " (spec.training.steps is " << trainer_.steps()
           << "): nothing to train\n";
    }
  }
  out_ << std::flush;
}

void RunReport::Step(const StepReport& report) {
  out_ << FormatStepReport(report) << "\n";
  if (first_step_) out_ << "memory (" << device_.ToString() << "): " << FormatMemory(trainer_.memory()) << "\n";
  first_step_ = false;
  out_ << std::flush;
}

void RunReport::Finished(const std::string& checkpoint_path) {
  const int64_t step = trainer_.checkpoint_stats().last_step;
  if (step >= 0) out_ << "checkpoint: step " << step << " in " << checkpoint_path << std::endl;
}

void RunReport::Sample(const std::string& text) { out_ << "sample:\n" << text << std::endl; }

}  // namespace meshtrain::train
