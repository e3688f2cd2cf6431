// The worker contract from both sides: what a worker's TrainingMetrics exports is what
// the operator's ParseProgress reads, through the text Prometheus serves; what a failing
// rank writes to its failure file is what its launcher reads.

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include "api/environment.h"
#include "api/worker_contract.h"
#include "operator/controller/worker_readings.h"
#include "worker/metrics/training_metrics.h"

namespace meshtrain {
namespace {

std::string Contents(const std::filesystem::path& path) {
  std::ostringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

TEST(WorkerContract, AFailingRankWritesOneLineToItsFailureFile) {
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("meshtrain-failure-" + std::to_string(::getpid()));
  ::setenv(api::worker::env::kFailureFile, file.c_str(), 1);
  api::WriteFailureReason("first");
  api::WriteFailureReason("rank 2 made no progress\nfor 3.0 s");
  EXPECT_EQ(Contents(file), "rank 2 made no progress for 3.0 s\n") << "replaced, on one line";
  api::WriteFailureReason(std::string(2 * api::worker::kFailureReasonBytes, 'x'));
  EXPECT_EQ(Contents(file), std::string(api::worker::kFailureReasonBytes, 'x') + "\n") << "cut";

  // No file named, or one that cannot be written: the rank's failure goes on as it was.
  ::setenv(api::worker::env::kFailureFile, (file / "not-a-directory" / "f").c_str(), 1);
  EXPECT_NO_THROW(api::WriteFailureReason("cannot be written: no error either"));
  ::setenv(api::worker::env::kFailureFile, "", 1);
  EXPECT_NO_THROW(api::WriteFailureReason("nowhere to write"));
  ::unsetenv(api::worker::env::kFailureFile);
  EXPECT_NO_THROW(api::WriteFailureReason("nowhere to write"));
  EXPECT_EQ(Contents(file), std::string(api::worker::kFailureReasonBytes, 'x') + "\n") << "left as it was";

  // A launcher's file in memory, by descriptor: written. A descriptor of that number that
  // is some other file (the launcher's was closed on the way): left alone.
  const int memory = ::memfd_create("meshtrain-test-failure", 0);
  ASSERT_GE(memory, 0);
  ::setenv(api::worker::env::kFailureFile, ("/proc/self/fd/" + std::to_string(memory)).c_str(), 1);
  api::WriteFailureReason("lost rank 0");
  EXPECT_EQ(Contents("/proc/self/fd/" + std::to_string(memory)), "lost rank 0\n");
  const int other = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(other, 0);
  ::setenv(api::worker::env::kFailureFile, ("/proc/self/fd/" + std::to_string(other)).c_str(), 1);
  api::WriteFailureReason("must not land in another file");
  EXPECT_EQ(Contents(file), std::string(api::worker::kFailureReasonBytes, 'x') + "\n") << "left as it was";
  ::unsetenv(api::worker::env::kFailureFile);
  ::close(memory);
  ::close(other);
  std::filesystem::remove(file);
}

std::string Exposition(const metrics::TrainingMetrics& exported) {
  return prometheus::TextSerializer().Serialize(exported.registry()->Collect());
}

TEST(WorkerContract, TheDeviceAndItsKernelsAreOneLabelledSeries) {
  metrics::TrainingMetrics exported("tiny", 3, /*steps=*/10, /*tokens_per_step=*/500);
  exported.DeviceInfo("cpu", "OpenBLAS 0.3.21 SkylakeX (Prescott detected; CPU has AVX-512)");
  EXPECT_NE(Exposition(exported).find("meshtrain_device_info{job_name=\"tiny\",rank=\"3\",device=\"cpu\",kernels="
                                      "\"OpenBLAS 0.3.21 SkylakeX (Prescott detected; CPU has AVX-512)\"} 1"),
            std::string::npos)
      << Exposition(exported);
}

// A mixture of experts' step: each block's busiest expert and mean (stat max, mean), their
// ratio, and the load-balancing loss, the series the dashboard's panel reads; a dense
// model's step keeps one imbalance series at 0 and an aux loss of 0.
TEST(WorkerContract, AMixtureOfExpertsExportsItsLoadByBlockAndItsAuxLoss) {
  metrics::TrainingMetrics exported("moe", 1, /*steps=*/10, /*tokens_per_step=*/500);
  train::StepReport dense;
  dense.step = 1;
  dense.steps = 10;
  exported.Step(dense);
  std::string text = Exposition(exported);
  EXPECT_NE(text.find("meshtrain_moe_expert_imbalance{job_name=\"moe\",rank=\"1\",layer=\"none\"} 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("meshtrain_moe_aux_loss{job_name=\"moe\",rank=\"1\"} 0"), std::string::npos) << text;

  train::StepReport report = dense;
  report.step = 2;
  report.expert_load[0] = {300, 200};
  report.expert_load[3] = {250, 250};
  report.aux_loss = 1.125;
  exported.Step(report);
  text = Exposition(exported);
  for (const std::string want :
       {"meshtrain_moe_tokens_per_expert{job_name=\"moe\",rank=\"1\",layer=\"0\",stat=\"max\"} 300",
        "meshtrain_moe_tokens_per_expert{job_name=\"moe\",rank=\"1\",layer=\"0\",stat=\"mean\"} 200",
        "meshtrain_moe_tokens_per_expert{job_name=\"moe\",rank=\"1\",layer=\"3\",stat=\"max\"} 250",
        "meshtrain_moe_expert_imbalance{job_name=\"moe\",rank=\"1\",layer=\"0\"} 1.5",
        "meshtrain_moe_expert_imbalance{job_name=\"moe\",rank=\"1\",layer=\"3\"} 1",
        "meshtrain_moe_aux_loss{job_name=\"moe\",rank=\"1\"} 1.125"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

TEST(WorkerContract, TheOperatorReadsWhatTheWorkerExports) {
  metrics::TrainingMetrics exported("tiny", 0, /*steps=*/1100, /*tokens_per_step=*/500);
  api::ProgressStatus before;
  ASSERT_TRUE(controller::ParseProgress(Exposition(exported), &before));
  EXPECT_EQ(before.step, 0);
  EXPECT_FALSE(before.resumed_from_step) << "a fresh worker says -1: none";
  EXPECT_FALSE(before.checkpoint_step);

  train::StepReport report;
  report.step = 100;
  report.steps = 1100;
  report.loss = 3.25;
  report.tokens_per_second = 5000;
  exported.Step(report);
  exported.ResumedFrom(60, 2);
  train::CheckpointStats stats;
  stats.written = 1;
  stats.last_step = 80;
  exported.Checkpoints(stats);

  const std::string text = Exposition(exported);
  for (const char* name : {api::worker::metric::kStep, api::worker::metric::kLoss, api::worker::metric::kSteps})
    EXPECT_NE(text.find(name), std::string::npos) << name;
  api::ProgressStatus progress;
  ASSERT_TRUE(controller::ParseProgress(text, &progress)) << text;
  EXPECT_EQ(progress.step, 100);
  EXPECT_DOUBLE_EQ(progress.loss, 3.25);
  EXPECT_DOUBLE_EQ(progress.tokens_per_second, 5000);
  EXPECT_EQ(progress.eta_seconds, 100);  // 1000 steps left x 500 tokens / 5000 tokens/s
  EXPECT_EQ(progress.resumed_from_step, std::optional<int64_t>(60));
  EXPECT_EQ(progress.damaged_checkpoints, std::optional<int64_t>(2));
  EXPECT_EQ(progress.checkpoint_step, std::optional<int64_t>(80));
}

}  // namespace
}  // namespace meshtrain
