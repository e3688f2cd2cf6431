#include "worker/metrics/training_metrics.h"

#include <prometheus/text_serializer.h>

#include "api/worker_contract.h"

namespace meshtrain::metrics {

namespace contract = api::worker::metric;

namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

prometheus::Gauge& NewGauge(prometheus::Registry& registry, const std::string& name, const std::string& help,
                            const prometheus::Labels& labels) {
  return BuildGauge().Name(name).Help(help).Labels(labels).Register(registry).Add({});
}

// One op's series of meshtrain_comm_seconds_total (the family is registered once per registry).
prometheus::Counter& CommSeconds(prometheus::Registry& registry, const prometheus::Labels& labels, const char* op) {
  return BuildCounter()
      .Name("meshtrain_comm_seconds_total")
      .Help("Seconds spent in collectives, by operation.")
      .Labels(labels)
      .Register(registry)
      .Add({{"op", op}});
}

prometheus::Histogram& NewHistogram(prometheus::Registry& registry, const std::string& name, const std::string& help,
                                   const prometheus::Labels& labels) {
  return BuildHistogram().Name(name).Help(help).Labels(labels).Register(registry).Add(
      {}, prometheus::Histogram::BucketBoundaries{0.001, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100});
}

}  // namespace

TrainingMetrics::TrainingMetrics(const std::string& job, int rank, int64_t steps, int64_t tokens_per_step)
    : TrainingMetrics(std::make_shared<prometheus::Registry>(),
                      prometheus::Labels{{"job_name", job}, {"rank", std::to_string(rank)}}, steps, tokens_per_step) {}

TrainingMetrics::TrainingMetrics(std::shared_ptr<prometheus::Registry> registry, const prometheus::Labels& labels,
                                 int64_t steps, int64_t tokens_per_step)
    : registry_(std::move(registry)),
      step_(NewGauge(*registry_, contract::kStep, "Optimizer steps done.", labels)),
      loss_(NewGauge(*registry_, contract::kLoss, "Mean training loss of the latest step (nats/token).",
                     labels)),
      validation_loss_(NewGauge(*registry_, "meshtrain_train_validation_loss",
                                "Latest validation loss (nats/token).", labels)),
      learning_rate_(NewGauge(*registry_, "meshtrain_train_learning_rate", "Learning rate of the latest step.",
                              labels)),
      grad_norm_(NewGauge(*registry_, "meshtrain_train_grad_norm", "Global gradient norm before clipping.",
                          labels)),
      tokens_per_second_(NewGauge(*registry_, contract::kTokensPerSecond,
                                  "Tokens per second of the whole job over the latest step.", labels)),
      tokens_(BuildCounter()
                  .Name("meshtrain_train_tokens_total")
                  .Help("Tokens the whole job has trained on.")
                  .Labels(labels)
                  .Register(*registry_)
                  .Add({})),
      step_seconds_(BuildHistogram()
                        .Name("meshtrain_train_step_duration_seconds")
                        .Help("Wall time of each optimizer step.")
                        .Labels(labels)
                        .Register(*registry_)
                        .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100})),
      memory_(BuildGauge()
                  .Name("meshtrain_memory_bytes")
                  .Help("Bytes this rank holds now, by category.")
                  .Labels(labels)
                  .Register(*registry_)),
      memory_peak_(BuildGauge()
                       .Name("meshtrain_memory_peak_bytes")
                       .Help("Most bytes this rank has held, by category.")
                       .Labels(labels)
                       .Register(*registry_)),
      all_gather_seconds_(CommSeconds(*registry_, labels, "all_gather")),
      reduce_scatter_seconds_(CommSeconds(*registry_, labels, "reduce_scatter")),
      all_reduce_seconds_(CommSeconds(*registry_, labels, "all_reduce")),
      exposed_comm_seconds_(BuildCounter()
                                .Name("meshtrain_comm_exposed_seconds_total")
                                .Help("Seconds the compute stream waited on communication.")
                                .Labels(labels)
                                .Register(*registry_)
                                .Add({})),
      send_seconds_(CommSeconds(*registry_, labels, "send")),
      recv_seconds_(CommSeconds(*registry_, labels, "recv")),
      ring_seconds_(CommSeconds(*registry_, labels, "ring")),
      all_to_all_seconds_(CommSeconds(*registry_, labels, "all_to_all")),
      neighbour_wait_seconds_(BuildCounter()
                                  .Name("meshtrain_pipeline_wait_seconds_total")
                                  .Help("Seconds the compute stream waited for the neighbouring pipeline stages.")
                                  .Labels(labels)
                                  .Register(*registry_)
                                  .Add({})),
      stage_bubble_(BuildGauge()
                        .Name("meshtrain_pipeline_bubble_ratio")
                        .Help("The last step's share a stage's compute stood waiting for its neighbours, by stage (0 with one stage).")
                        .Labels(labels)
                        .Register(*registry_)),
      bubble_model_(NewGauge(*registry_, "meshtrain_pipeline_bubble_model_ratio",
                             "The schedule's model of the bubble, (P-1)/(VM+P-1); 0 without a pipeline.", labels)),
      expert_tokens_(BuildGauge()
                         .Name("meshtrain_moe_tokens_per_expert")
                         .Help("A mixture of experts' block's busiest expert's tokens (stat max) and its experts' "
                               "mean (stat mean), the last step on this rank, by block.")
                         .Labels(labels)
                         .Register(*registry_)),
      expert_imbalance_(BuildGauge()
                            .Name("meshtrain_moe_expert_imbalance")
                            .Help("A mixture of experts' block's busiest expert's tokens over the mean, the last step "
                                  "on this rank, by block (a dense model: layer none, 0).")
                            .Labels(labels)
                            .Register(*registry_)),
      aux_loss_(NewGauge(*registry_, "meshtrain_moe_aux_loss",
                         "A mixture of experts' load-balancing loss the last step (mean over its micro-batches, "
                         "before its coefficient; 0 without one).",
                         labels)),
      checkpoint_seconds_(NewHistogram(*registry_, "meshtrain_checkpoint_seconds",
                                       "Seconds to write a checkpoint, from the snapshot to the files in place.",
                                       labels)),
      checkpoint_stall_seconds_(NewHistogram(*registry_, "meshtrain_checkpoint_stall_seconds",
                                             "Seconds a checkpoint step waited for its snapshot.", labels)),
      checkpoint_last_step_(NewGauge(*registry_, contract::kCheckpointLastStep,
                                     "The step of the newest checkpoint written (-1: none).", labels)),
      checkpoint_bytes_(NewGauge(*registry_, "meshtrain_checkpoint_bytes",
                                 "Bytes this rank wrote into the newest checkpoint.", labels)),
      resumed_from_step_(NewGauge(*registry_, contract::kResumedFromStep,
                                  "The checkpoint step this run resumed from (-1: it started fresh).", labels)),
      damaged_checkpoints_(NewGauge(*registry_, contract::kResumeDamagedCheckpoints,
                                    "Newer checkpoints the resume skipped as damaged.", labels)),
      model_flops_per_token_(NewGauge(*registry_, "meshtrain_train_model_flops_per_token",
                                      "Matrix FLOPs of forward and backward per token (6N + 12LTC).", labels)),
      peak_flops_(NewGauge(*registry_, "meshtrain_train_peak_flops",
                           "Dense bf16 peak FLOP/s of all the job's devices; 0 when unknown (CPU).", labels)),
      checkpoint_failures_(BuildCounter()
                               .Name("meshtrain_checkpoint_failures_total")
                               .Help("Checkpoints that failed to write (the previous one stays).")
                               .Labels(labels)
                               .Register(*registry_)
                               .Add({})),
      tokens_per_step_(tokens_per_step),
      labels_(labels) {
  checkpoint_last_step_.Set(-1);
  resumed_from_step_.Set(-1);
  NewGauge(*registry_, contract::kSteps, "Optimizer steps in the job.", labels).Set(double(steps));
  NewGauge(*registry_, contract::kTokensPerStep, "Tokens in one global batch.", labels)
      .Set(double(tokens_per_step));
}

void TrainingMetrics::Serve(const std::string& host, int port) {
  // prometheus-cpp's Registry may be collected from the endpoint's thread.
  std::vector<HttpRoute> routes =
      MetricsRoutes([registry = registry_] { return prometheus::TextSerializer().Serialize(registry->Collect()); });
  endpoint_ = std::make_unique<HttpEndpoint>(host, port, std::move(routes), HttpEndpointOptions{.name = "metrics"});
}

int TrainingMetrics::port() const { return endpoint_->port(); }

void TrainingMetrics::Step(const train::StepReport& report) {
  step_.Set(double(report.step));
  loss_.Set(report.loss);
  if (report.validation_loss) validation_loss_.Set(*report.validation_loss);
  learning_rate_.Set(report.learning_rate);
  grad_norm_.Set(report.grad_norm);
  tokens_per_second_.Set(report.tokens_per_second);
  tokens_.Increment(double(tokens_per_step_));
  step_seconds_.Observe(report.seconds);
  all_gather_seconds_.Increment(report.comm.all_gather);
  reduce_scatter_seconds_.Increment(report.comm.reduce_scatter);
  all_reduce_seconds_.Increment(report.comm.all_reduce);
  exposed_comm_seconds_.Increment(report.comm.exposed);
  send_seconds_.Increment(report.comm.send);
  recv_seconds_.Increment(report.comm.recv);
  ring_seconds_.Increment(report.comm.ring);
  all_to_all_seconds_.Increment(report.comm.all_to_all);
  neighbour_wait_seconds_.Increment(report.comm.neighbour_wait);
  // One stage has no bubble: its series reads 0, so a dashboard shows every job alike.
  if (report.stage_bubbles.empty()) stage_bubble_.Add({{"stage", "0"}}).Set(0);
  for (size_t stage = 0; stage < report.stage_bubbles.size(); ++stage) {
    stage_bubble_.Add({{"stage", std::to_string(stage)}}).Set(report.stage_bubbles[stage]);
  }
  bubble_model_.Set(report.bubble_model);
  // A dense model has no experts: its one series reads 0, so a dashboard shows every job alike.
  if (report.expert_load.empty()) expert_imbalance_.Add({{"layer", "none"}}).Set(0);
  for (const auto& [block, load] : report.expert_load) {
    const std::string layer = std::to_string(block);
    expert_tokens_.Add({{"layer", layer}, {"stat", "max"}}).Set(load.max);
    expert_tokens_.Add({{"layer", layer}, {"stat", "mean"}}).Set(load.mean);
    expert_imbalance_.Add({{"layer", layer}}).Set(load.imbalance());
  }
  aux_loss_.Set(report.aux_loss.value_or(0));
  if (report.checkpoint_stall) checkpoint_stall_seconds_.Observe(*report.checkpoint_stall);
}

void TrainingMetrics::ResumedFrom(int64_t step, int64_t damaged) {
  resumed_from_step_.Set(double(step));
  damaged_checkpoints_.Set(double(damaged));
}

void TrainingMetrics::Flops(double model_flops_per_token, double job_peak_flops) {
  model_flops_per_token_.Set(model_flops_per_token);
  peak_flops_.Set(job_peak_flops);
}

void TrainingMetrics::DeviceInfo(const std::string& device, const std::string& kernels) {
  BuildGauge()
      .Name("meshtrain_device_info")
      .Help("1, labelled with the rank's device and what runs its kernels (the BLAS library and core on a CPU).")
      .Labels(labels_)
      .Register(*registry_)
      .Add({{"device", device}, {"kernels", kernels}})
      .Set(1);
}

void TrainingMetrics::Checkpoints(const train::CheckpointStats& stats) {
  if (stats.written > checkpoints_seen_) {
    checkpoint_seconds_.Observe(stats.last_seconds);
    checkpoint_last_step_.Set(double(stats.last_step));
    checkpoint_bytes_.Set(double(stats.last_bytes));
    checkpoints_seen_ = stats.written;
  }
  if (stats.failures > failures_seen_) {
    checkpoint_failures_.Increment(double(stats.failures - failures_seen_));
    failures_seen_ = stats.failures;
  }
}

void TrainingMetrics::Memory(const runtime::MemoryAccounting& accounting) {
  for (size_t i = 0; i < runtime::kMemoryCategories; ++i) {
    const auto category = static_cast<runtime::MemoryCategory>(i);
    const prometheus::Labels labels{{"category", runtime::MemoryCategoryName(category)}};
    memory_.Add(labels).Set(double(accounting.current(category)));
    memory_peak_.Add(labels).Set(double(accounting.peak(category)));
  }
}

}  // namespace meshtrain::metrics
