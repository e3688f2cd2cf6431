// What a training run prints as it goes, the same from `meshtrain run` and from rank 0 of
// a job: checkpoint warnings and where it resumed, each step, the memory after the first
// step, the newest checkpoint, and the sample.
//
// Thread-safety: one thread (the one that runs the Trainer).

#pragma once

#include <ostream>
#include <string>

#include "worker/runtime/device.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {

class RunReport {
 public:
  // `trainer` outlives the report.
  RunReport(std::ostream& out, const Trainer& trainer, runtime::Device device);

  // The checkpoint warnings, and "resumed from step N (DIR)" when the trainer resumed,
  // with a line saying so when the job is complete at that step.
  void Started();
  // "step ..." (FormatStepReport); after the first, "memory (DEVICE): ...".
  void Step(const StepReport& report);
  // "checkpoint: step N in PATH" when a checkpoint was written.
  void Finished(const std::string& checkpoint_path);
  void Sample(const std::string& text);

 private:
  std::ostream& out_;
  const Trainer& trainer_;
  runtime::Device device_;
  bool first_step_ = true;
};

}  // namespace meshtrain::train
