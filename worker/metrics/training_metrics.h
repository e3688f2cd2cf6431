// One rank's training metrics for Prometheus (docs/design.md, "Names": meshtrain_ prefix,
// base units). Every series carries the constant labels job_name and rank (not "job",
// which Prometheus keeps for the scrape job).
//
//   meshtrain_train_step, meshtrain_train_steps           gauges: steps done, steps in the job
//   meshtrain_train_loss, meshtrain_train_validation_loss gauges: latest losses (nats/token)
//   meshtrain_train_learning_rate, meshtrain_train_grad_norm
//   meshtrain_train_tokens_per_second, meshtrain_train_tokens_per_step
//   meshtrain_train_tokens_total                          counter
//   meshtrain_train_step_duration_seconds                 histogram
//   meshtrain_memory_bytes{category}, meshtrain_memory_peak_bytes{category}
//   meshtrain_checkpoint_seconds                          histogram: write time, snapshot to done
//   meshtrain_checkpoint_stall_seconds                    histogram: what a checkpoint step waited
//   meshtrain_checkpoint_last_step, meshtrain_checkpoint_bytes  gauges: the newest written, this rank's bytes
//   meshtrain_checkpoint_failures_total                   counter
//   meshtrain_train_resumed_from_step                     gauge: the checkpoint this run resumed from (-1: none)
//   meshtrain_train_resume_damaged_checkpoints            gauge: newer checkpoints that resume skipped
//   meshtrain_train_model_flops_per_token                 gauge: 6N + 12LTC, the numerator of MFU
//   meshtrain_train_peak_flops                            gauge: the dense bf16 peak of all the job's devices (0: unknown, as on CPU)
//   meshtrain_comm_seconds_total{op}                      counter: all_gather, reduce_scatter, all_reduce, a
//                                                         pipeline's send and recv, context parallelism's
//                                                         ring and all_to_all
//   meshtrain_pipeline_wait_seconds_total                 counter: seconds this rank's compute waited on its neighbouring stages
//   meshtrain_pipeline_bubble_ratio{stage}                gauge: the last step's measured bubble of each stage
//   meshtrain_pipeline_bubble_model_ratio                 gauge: the schedule's model of it, (P-1)/(VM+P-1)
//   meshtrain_moe_tokens_per_expert{layer,stat}           gauge: a mixture of experts' block's busiest expert's
//                                                         tokens (stat "max") and its experts' mean ("mean"),
//                                                         the last step on this rank
//   meshtrain_moe_expert_imbalance{layer}                 gauge: the two's ratio (a dense model: layer "none", 0)
//   meshtrain_moe_aux_loss                                gauge: the last step's load-balancing loss, before its
//                                                         coefficient (0 without one)
//
// The operator reads the names of api/worker_contract.h (api::worker::metric) from rank 0
// to fill a TrainingJob's status.progress.
// Thread-safe (prometheus-cpp metrics are atomic).

#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "worker/metrics/http_endpoint.h"
#include "worker/runtime/memory.h"
#include "worker/train/trainer.h"

namespace meshtrain::metrics {

class TrainingMetrics {
 public:
  TrainingMetrics(const std::string& job, int rank, int64_t steps, int64_t tokens_per_step);

  // Serves GET /metrics, and /healthz, on host:port (port 0: any free port; an
  // HttpEndpoint). Throws std::runtime_error naming the address if it cannot listen.
  void Serve(const std::string& host, int port);
  int port() const;  // the port served on; REQUIRES: Serve() was called

  void Step(const train::StepReport& report);
  void Memory(const runtime::MemoryAccounting& accounting);
  // The trainer's checkpoint counters; call after each step (from one thread).
  void Checkpoints(const train::CheckpointStats& stats);
  // The checkpoint this run resumed from, after skipping `damaged` newer ones.
  void ResumedFrom(int64_t step, int64_t damaged);
  // What MFU is counted from: model FLOPs per token, and the dense peak of all the job's
  // devices (0: unknown). MFU = tokens_per_second x model_flops_per_token / peak_flops.
  void Flops(double model_flops_per_token, double job_peak_flops);
  // meshtrain_device_info{device, kernels} = 1: the rank's device ("cpu", "cuda:0") and
  // what runs its kernels ("OpenBLAS 0.3.21 SkylakeX (Prescott detected; CPU has
  // AVX-512)" on a CPU, the device's name on a GPU).
  void DeviceInfo(const std::string& device, const std::string& kernels);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  TrainingMetrics(std::shared_ptr<prometheus::Registry> registry, const prometheus::Labels& labels, int64_t steps,
                  int64_t tokens_per_step);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<HttpEndpoint> endpoint_;
  prometheus::Gauge &step_, &loss_, &validation_loss_, &learning_rate_, &grad_norm_, &tokens_per_second_;
  prometheus::Counter& tokens_;
  prometheus::Histogram& step_seconds_;
  prometheus::Family<prometheus::Gauge>& memory_;
  prometheus::Family<prometheus::Gauge>& memory_peak_;
  prometheus::Counter &all_gather_seconds_, &reduce_scatter_seconds_, &all_reduce_seconds_, &exposed_comm_seconds_;
  prometheus::Counter &send_seconds_, &recv_seconds_, &ring_seconds_, &all_to_all_seconds_, &neighbour_wait_seconds_;
  prometheus::Family<prometheus::Gauge>& stage_bubble_;
  prometheus::Gauge& bubble_model_;
  prometheus::Family<prometheus::Gauge>& expert_tokens_;
  prometheus::Family<prometheus::Gauge>& expert_imbalance_;
  prometheus::Gauge& aux_loss_;
  prometheus::Histogram &checkpoint_seconds_, &checkpoint_stall_seconds_;
  prometheus::Gauge &checkpoint_last_step_, &checkpoint_bytes_, &resumed_from_step_, &damaged_checkpoints_;
  prometheus::Gauge &model_flops_per_token_, &peak_flops_;
  prometheus::Counter& checkpoint_failures_;
  int64_t tokens_per_step_;
  prometheus::Labels labels_;  // the job's and rank's, on every series
  int64_t checkpoints_seen_ = 0, failures_seen_ = 0;  // of the stats last passed to Checkpoints
};

}  // namespace meshtrain::metrics
