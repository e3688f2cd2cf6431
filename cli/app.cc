#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "api/logging.h"
#include "cli/commands.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::cli {

namespace {

// "1K..256M" (K, M, G are powers of 1024; "64M" alone means 64M..64M).
bool ParseSizeRange(const std::string& text, size_t* min_bytes, size_t* max_bytes) {
  auto parse = [](std::string part, size_t* value) {
    if (part.empty()) return false;
    size_t unit = 1;
    switch (part.back()) {
      case 'K': case 'k': unit = size_t{1} << 10; break;
      case 'M': case 'm': unit = size_t{1} << 20; break;
      case 'G': case 'g': unit = size_t{1} << 30; break;
      default: break;
    }
    if (unit != 1) part.pop_back();
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 6) return false;
    *value = std::stoull(part) * unit;
    return *value > 0;
  };
  size_t dots = text.find("..");
  if (dots == std::string::npos) return parse(text, min_bytes) && parse(text, max_bytes);
  return parse(text.substr(0, dots), min_bytes) && parse(text.substr(dots + 2), max_bytes) &&
         *min_bytes <= *max_bytes;
}

std::string VersionString() {
#ifdef MESHTRAIN_HAVE_CUDA
  constexpr const char* cuda = "on";
#else
  constexpr const char* cuda = "off";
#endif
  return std::string("meshtrain ") + MESHTRAIN_VERSION + " (cuda " + cuda + ")";
}

}  // namespace

int Main(int argc, char** argv) {
  CLI::App app{"meshtrain: train large models across GPU clusters, or on this machine", "meshtrain"};
  app.set_version_flag("--version", VersionString());
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "Log level")
      ->check(CLI::IsMember(LogLevelNames()))
      ->capture_default_str();

  std::vector<std::string> files;
  CLI::App* validate = app.add_subcommand("validate", "Check TrainingJob manifests; print ok or each error with its field path");
  validate->add_option("files", files, "Manifest files (YAML or JSON)")->required();

  std::string file;
  CLI::App* layout = app.add_subcommand("layout", "Print a job's mesh: which ranks form each TP, shard and replica group");
  layout->add_option("file", file, "Manifest file")->required();

  RunOptions run_options;
  CLI::App* run = app.add_subcommand("run", "Train a job on this machine");
  run->add_option("file", run_options.file, "Manifest file with one TrainingJob")->required();
  run->add_flag("--resume,!--no-resume", run_options.resume,
                "Resume from the newest intact checkpoint under spec.checkpoint.path (the default)");
  run->add_option("--sample-tokens", run_options.sample_tokens, "Tokens of text to sample after training")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();

  std::string checkpoint_path;
  CLI::App* checkpoints = app.add_subcommand("checkpoints", "List a job's checkpoints and verify their files");
  checkpoints->add_option("path", checkpoint_path, "The job's spec.checkpoint.path")->required();

  std::string export_checkpoint, export_format = "safetensors", export_output;
  CLI::App* export_ = app.add_subcommand("export", "Write a checkpoint's weights as a Hugging Face GPT-2");
  export_->add_option("checkpoint", export_checkpoint, "A checkpoint directory (PATH/step-N)")->required();
  export_->add_option("output", export_output, "The file to write")->required();
  export_->add_option("--format", export_format, "safetensors")->capture_default_str();

  PrepareDataOptions prepare_options;
  CLI::App* prepare = app.add_subcommand("prepare-data", "Turn a text file into token files (byte-level tokenizer)");
  prepare->add_option("input", prepare_options.input, "Text file")->required();
  prepare->add_option("output", prepare_options.output, "Token file to write")->required();
  prepare->add_option("--validation", prepare_options.validation, "Also write the end of the text here, for validation");
  prepare->add_option("--validation-fraction", prepare_options.validation_fraction, "Share of the text for validation")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();

  PlanOptions plan_options;
  CLI::App* plan = app.add_subcommand("plan", "Place a job on a cluster by topology and compare with a topology-blind placement");
  plan->add_option("job", plan_options.job_file, "Manifest file with one TrainingJob")->required();
  auto* cluster_opt = plan->add_option("--cluster", plan_options.cluster_file, "Compact cluster description (YAML or JSON)");
  auto* nodes_opt = plan->add_option("--nodes-json", plan_options.nodes_json, "Output of kubectl get nodes -o json");
  plan->add_option("--pods-json", plan_options.pods_json, "Output of kubectl get pods -A -o json")->needs(nodes_opt);
  cluster_opt->excludes(nodes_opt);
  plan->add_option("--link", plan_options.link_overrides,
                   "Override a link: LEVEL=GBPS[,LATENCY_US], LEVEL being nvlink, cluster or a topology level");
  plan->add_option("--avoid", plan_options.avoid, "A node not to use");
  std::string output = "text";
  plan->add_option("--output,-o", output, "text or json")->check(CLI::IsMember({"text", "json"}))->capture_default_str();

  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  BenchPlanOptions bench_plan_options;
  CLI::App* bench_plan = bench->add_subcommand("plan", "Placement time and topology-aware vs blind communication");
  bench_plan->add_option("--nodes", bench_plan_options.nodes, "Nodes per generated cluster")->capture_default_str();
  bench_plan->add_option("--clusters", bench_plan_options.clusters, "Clusters for the ratio")->capture_default_str();
  bench_plan->add_option("--seed", bench_plan_options.seed, "First random seed")->capture_default_str();

  BenchTrainOptions bench_train_options;
  CLI::App* bench_train = bench->add_subcommand("train", "Training throughput and MFU on this machine");
  bench_train->add_option("--model", bench_train_options.model, "Model preset")->capture_default_str();
  bench_train->add_option("--batch", bench_train_options.batch, "Micro-batch size")->check(CLI::Range(1, 4096))->capture_default_str();
  bench_train->add_option("--seq", bench_train_options.seq, "Sequence length")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  bench_train->add_option("--steps", bench_train_options.steps, "Measured steps")->check(CLI::Range(1, 100000))->capture_default_str();
  bench_train->add_option("--ranks", bench_train_options.ranks, "Ranks, as processes on this machine (cpu)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  bench_train->add_option("--shard", bench_train_options.shard, "hybridShardDegree of the ranks (0: all)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  bench_train->add_option("--tp", bench_train_options.tp, "tensorParallelDegree of the ranks")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  bench_train->add_flag("--checkpointing", bench_train_options.checkpointing, "Activation checkpointing");
  bench_train->add_option("--offload", bench_train_options.offload,
                          "Offload activations with this loading horizon (turns checkpointing on)")
      ->check(CLI::Range(1, 1024));
  bench_train->add_option("--compare", bench_train_options.compare,
                          "replicated: also run the ranks replicated; activations: keep all, checkpointing and "
                          "offload side by side; data-parallel: the ranks without TP; with ratios")
      ->check(CLI::IsMember({"replicated", "activations", "data-parallel"}));
  bench_train->add_option("--device", bench_train_options.device, "cpu (fp32) or cuda (bf16 on GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();

  BenchCheckpointOptions bench_checkpoint_options;
  CLI::App* bench_checkpoint =
      bench->add_subcommand("checkpoint", "A checkpoint's stall on the training step against a blocking write");
  bench_checkpoint->add_option("--model", bench_checkpoint_options.model, "Model preset")->capture_default_str();
  bench_checkpoint->add_option("--dir", bench_checkpoint_options.dir, "Where to write (default: a temporary directory)");
  bench_checkpoint->add_option("--repeats", bench_checkpoint_options.repeats, "Checkpoints of each kind")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();

  BenchCommOptions bench_comm_options;
  std::string sizes = "1K..64M";
  CLI::App* bench_comm = bench->add_subcommand("comm", "Collective bandwidth over the fabric backend, ranks on virtual nodes");
  bench_comm->add_option("--ranks", bench_comm_options.ranks, "Ranks")->check(CLI::Range(1, 64))->capture_default_str();
  bench_comm->add_option("--nodes", bench_comm_options.nodes, "Virtual nodes (ranks divide evenly)")->check(CLI::Range(1, 64))->capture_default_str();
  bench_comm->add_option("--op", bench_comm_options.op, "Collective")
      ->check(CLI::IsMember({"all_gather", "reduce_scatter", "all_reduce", "broadcast"}))
      ->capture_default_str();
  bench_comm->add_option("--sizes", sizes, "Sizes MIN..MAX in bytes (K, M, G suffixes), doubling")->capture_default_str();
  bench_comm->add_option("--algorithm", bench_comm_options.algorithm, "Force auto, ring, log or hierarchical");
  bench_comm->add_flag("--in-place", bench_comm_options.in_place, "Operate in place");
  bench_comm->add_flag("--heap-buffers", bench_comm_options.heap_buffers,
                       "Use heap memory instead of the communicator's (intra-node peers then copy through the provider)");
  bench_comm->add_option("--warmup", bench_comm_options.warmup, "Unmeasured iterations per size")->capture_default_str();

  BenchOperatorOptions bench_operator_options;
  CLI::App* bench_operator = bench->add_subcommand("operator", "The operator against the test API server: job-to-pods latency, requests, memory");
  bench_operator->add_option("--nodes", bench_operator_options.nodes, "Nodes in the synthetic cluster")->check(CLI::Range(1, 100000))->capture_default_str();
  bench_operator->add_option("--jobs", bench_operator_options.jobs, "Jobs to create")->check(CLI::Range(1, 100000))->capture_default_str();
  bench_operator->add_option("--job-nodes", bench_operator_options.job_nodes, "Nodes per job")->check(CLI::Range(1, 4096))->capture_default_str();
  bench_operator->add_option("--gpus-per-node", bench_operator_options.gpus_per_node, "GPUs per pod")->check(CLI::Range(1, 8))->capture_default_str();
  bench_operator->add_option("--interval-ms", bench_operator_options.interval_ms, "Time between job creations")->check(CLI::Range(0, 60000))->capture_default_str();
  bench_operator->add_option("--workers", bench_operator_options.workers, "Operator --workers")->capture_default_str();
  bench_operator->add_option("--qps", bench_operator_options.qps, "Operator --qps")->capture_default_str();
  bench_operator->add_option("--burst", bench_operator_options.burst, "Operator --burst")->capture_default_str();
  bench_operator->add_option("--timeout", bench_operator_options.timeout_seconds, "Seconds to wait for all pods")->capture_default_str();
  bench_operator->add_option("--hanging-metrics", bench_operator_options.hanging_metrics,
                             "Then as many jobs again, while this many jobs' metrics endpoints hang")->check(CLI::Range(0, 1000))->capture_default_str();
  bench_operator->add_option("--crd", bench_operator_options.crd, "The TrainingJob CRD")->capture_default_str();
  bench_operator->add_option("--apiserver", bench_operator_options.apiserver, "meshtrain-test-apiserver binary");
  bench_operator->add_option("--operator", bench_operator_options.operator_binary, "meshtrain-operator binary");

  LaunchOptions launch_options;
  CLI::App* launch = app.add_subcommand("launch", "Run a command as the ranks of a job on virtual nodes of this machine");
  launch->add_option("--nodes", launch_options.nodes, "Virtual nodes")->check(CLI::Range(1, 256))->capture_default_str();
  launch->add_option("--nproc-per-node", launch_options.ranks_per_node, "Ranks per node")->check(CLI::Range(1, 256))->capture_default_str();
  launch->add_option("--timeout", launch_options.timeout_seconds, "Stop the job after this many seconds (0: never)")->capture_default_str();
  launch->add_option("command", launch_options.command, "The rank command (after --)")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUnreadable;
  }
  InitLogging("meshtrain", log_level);

  if (*validate) return ValidateCommand(files, std::cout);
  if (*layout) return LayoutCommand(file, std::cout);
  if (*run) return RunCommand(run_options, std::cout);
  if (*checkpoints) return CheckpointsCommand(checkpoint_path, std::cout);
  if (*export_) return ExportCommand(export_checkpoint, export_format, export_output, std::cout);
  if (*prepare) return PrepareDataCommand(prepare_options, std::cout);
  if (*plan) {
    if (plan_options.cluster_file.empty() && plan_options.nodes_json.empty()) {
      std::cerr << "meshtrain plan: give --cluster FILE or --nodes-json FILE\n";
      return kExitUnreadable;
    }
    plan_options.json = output == "json";
    return PlanCommand(plan_options, std::cout);
  }
  if (*bench_plan) return BenchPlanCommand(bench_plan_options, std::cout);
  if (*bench_train) return BenchTrainCommand(bench_train_options, meshtrain::launch::SelfCommand(argc, argv), std::cout);
  if (*bench_operator) return BenchOperatorCommand(bench_operator_options, std::cout);
  if (*bench_checkpoint) return BenchCheckpointCommand(bench_checkpoint_options, std::cout);
  if (*bench_comm) {
    if (!ParseSizeRange(sizes, &bench_comm_options.min_bytes, &bench_comm_options.max_bytes)) {
      std::cerr << "meshtrain bench comm: --sizes \"" << sizes << "\" is not MIN..MAX (like 1K..256M)\n";
      return kExitUnreadable;
    }
    return BenchCommCommand(bench_comm_options, meshtrain::launch::SelfCommand(argc, argv), std::cout);
  }
  if (*launch) return LaunchCommand(launch_options, std::cout);
  return kExitUnreadable;
}

}  // namespace meshtrain::cli
