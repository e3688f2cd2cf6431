// meshtrain-worker across real processes: data-parallel runs against the single-rank
// run, the pod launcher's signals and teardown, configuration errors, the metrics
// endpoint, and strangers on the rendezvous Store. MESHTRAIN_CLI and MESHTRAIN_WORKER are the binaries under test.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include <cpprest/http_client.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/manifest.h"
#include "tests/support/child_process.h"
#include "tests/support/store_intruder.h"
#include "worker/launch/local_launcher.h"
#include "worker/train/checkpoint.h"
#include "worker/train/token_file.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

using Outcome = testing::ChildExit;
using Process = testing::ChildProcess;

// The steps a run printed: loss, grad norm and validation loss (NaN when absent).
struct StepLine {
  double loss, norm, validation;
};

std::vector<StepLine> Steps(const std::string& output) {
  static const std::regex step(R"(step +\d+/\d+ \| loss ([0-9.]+) \| lr [^|]+\| norm ([0-9.]+) \|[^|\n]*(\| val loss ([0-9.]+))?)");
  std::vector<StepLine> steps;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), step); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    steps.push_back({std::stod(m[1]), std::stod(m[2]), m[4].matched ? std::stod(m[4]) : std::nan("")});
  }
  return steps;
}

// The output of a run killed once step 9 was done, after its restart: it resumed from step
// 8's checkpoint, and steps 9-12 print the uninterrupted run's losses and norms (4
// decimals: the same digits).
void ExpectResumedAtStep8AsTheStraightRun(const std::string& straight, const std::string& after) {
  EXPECT_NE(after.find("resumed from step 8 ("), std::string::npos) << after;
  const std::vector<StepLine> want = Steps(straight), got = Steps(after);
  ASSERT_EQ(got.size(), 4u) << after;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].loss, want[8 + i].loss) << "step " << 9 + i;
    EXPECT_EQ(got[i].norm, want[8 + i].norm) << "step " << 9 + i;
  }
}


class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-worker-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    // The bundled corpus, split 90/10 as `meshtrain prepare-data` does.
    const auto split = train::WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                                                (dir_ / "val.bin").string(), 0.1);
    ASSERT_GT(split.train, 600000u);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The tiny example on `nodes` x `gpus` ranks; the global batch stays 2048 tokens, so
  // every layout trains on exactly the same samples per step.
  fs::path Job(const std::string& name, int nodes, int gpus, int steps) {
    nlohmann::json job = api::ReadManifestFile("examples/gpt2-tiny-local.yaml").at(0).object;
    job["metadata"]["name"] = name;
    job["spec"]["nodes"] = nodes;
    job["spec"]["gpusPerNode"] = gpus;
    job["spec"]["data"] = {{"train", (dir_ / "train.bin").string()}, {"validation", (dir_ / "val.bin").string()}};
    auto& training = job["spec"]["training"];
    training["steps"] = steps;
    training["globalBatchTokens"] = 2048;
    training["microBatchSize"] = 8 / (nodes * gpus);
    training["warmupSteps"] = 2;
    training["evalInterval"] = 3;
    training["evalBatches"] = 2;
    job["spec"]["checkpoint"] = {{"path", (dir_ / (name + "-checkpoints")).string()}, {"interval", 4}, {"keep", 2}};
    const fs::path path = dir_ / (name + ".json");
    std::ofstream(path) << job.dump(2);
    return path;
  }

  Outcome MeshtrainRun(const fs::path& job) {
    Process p({MESHTRAIN_CLI, "run", job.string(), "--sample-tokens", "20"}, {}, dir_ / (job.stem().string() + ".log"));
    return p.Wait(120s);
  }

  // The worker contract's environment for node 0 of one node with `ranks` ranks.
  std::map<std::string, std::string> PodEnvironment(const fs::path& job, int ranks) {
    const fs::path table = dir_ / "rank-table.json";
    std::ofstream(table) << api::ToJson(launch::VirtualRankTable(1, ranks)).dump();
    return {{"MESHTRAIN_JOB_NAME", job.stem().string()},
            {"MESHTRAIN_CONFIG", job.string()},
            {"MESHTRAIN_RANK_TABLE", table.string()},
            {"MESHTRAIN_COORDINATOR", "127.0.0.1:" + std::to_string(launch::FreeLoopbackPort())},
            {"MESHTRAIN_NODE_RANK", "0"},
            {"MESHTRAIN_NNODES", "1"},
            {"MESHTRAIN_NPROC_PER_NODE", std::to_string(ranks)},
            {"OMP_NUM_THREADS", "1"}};
  }

  fs::path dir_;
};

TEST_F(WorkerTest, DataParallelRunsMatchTheSingleRankRun) {
  const Outcome one = MeshtrainRun(Job("one", 1, 1, 6));
  const Outcome shm = MeshtrainRun(Job("shm", 1, 2, 6));   // two ranks on one node: shm
  const Outcome tcp = MeshtrainRun(Job("tcp", 2, 2, 6));   // two virtual nodes: tcp;ofi_rxm between them
  ASSERT_EQ(one.status, 0) << one.output;
  ASSERT_EQ(shm.status, 0) << shm.output;
  ASSERT_EQ(tcp.status, 0) << tcp.output;
  EXPECT_NE(tcp.output.find("launching 4 ranks"), std::string::npos) << tcp.output;
  // Every run ends with a checkpoint of its last step; nothing warns about the checkpoint
  // block, or any field, having no effect: the one engine acts on them all.
  for (const Outcome* run : {&one, &shm, &tcp}) {
    EXPECT_NE(run->output.find("checkpoint: step 6 in "), std::string::npos) << run->output;
    EXPECT_EQ(run->output.find("spec.checkpoint: has no effect"), std::string::npos) << run->output;
    EXPECT_EQ(run->output.find("has no effect"), std::string::npos) << run->output;
  }
  // The sharded engine of each layout, on the CPU with the fp32 kernels.
  EXPECT_TRUE(std::regex_search(
      one.output, std::regex(R"((^|\n)  model: fp32 FSDP, 1 replica x 1 shard x tp 1; 5 units, each whole on this rank; cpu fp32 on cpu\n)")))
      << one.output;
  EXPECT_TRUE(std::regex_search(
      shm.output, std::regex(R"(rank 0 model: fp32 FSDP, 1 replica x 2 shards x tp 1, [^\n]*; 5 units, each split in 2 shards [^\n]*; cpu fp32 on cpu\n)")))
      << shm.output;
  EXPECT_TRUE(std::regex_search(
      tcp.output, std::regex(R"(rank 0 model: fp32 FSDP, 1 replica x 4 shards x tp 1, [^\n]*; 5 units, each split in 4 shards [^\n]*; cpu fp32 on cpu\n)")))
      << tcp.output;
  const auto reference = Steps(one.output);
  ASSERT_EQ(reference.size(), 6u) << one.output;
  EXPECT_LT(reference.back().loss, reference.front().loss - 0.5);
  for (const Outcome* run : {&shm, &tcp}) {
    const auto steps = Steps(run->output);
    ASSERT_EQ(steps.size(), reference.size()) << run->output;
    for (size_t i = 0; i < steps.size(); ++i) {
      // Printed to 4 decimals; only the order of the gradient sums differs.
      EXPECT_NEAR(steps[i].loss, reference[i].loss, 2e-4) << "step " << i + 1;
      EXPECT_NEAR(steps[i].norm, reference[i].norm, 2e-3 * reference[i].norm) << "step " << i + 1;
      EXPECT_EQ(std::isnan(steps[i].validation), std::isnan(reference[i].validation)) << "step " << i + 1;
      if (!std::isnan(reference[i].validation)) {
        EXPECT_NEAR(steps[i].validation, reference[i].validation, 2e-4) << "step " << i + 1;
      }
    }
  }
}

// Waits until `run` of `job` has printed `steps` steps and the newest checkpoint at or
// before them is complete (its `latest` names it): checkpoints are written behind the
// steps, so a rank stopped or killed the moment step 9 prints may not have finished step
// 8's yet, and the gang would rightly resume from step 4. Before the first interval there
// is no checkpoint to wait for.
void WaitForStepsAndTheirCheckpoint(Process& run, const fs::path& job, size_t steps) {
  const nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
  const fs::path latest = fs::path(manifest["spec"]["checkpoint"]["path"].get<std::string>()) / "latest";
  const int64_t interval = manifest["spec"]["checkpoint"]["interval"].get<int64_t>();
  const int64_t due = int64_t(steps) / interval * interval;  // 0: no checkpoint is due yet
  char want[32];
  std::snprintf(want, sizeof want, "step-%08lld", static_cast<long long>(due));
  auto written = [&] {
    if (due == 0) return true;
    std::ifstream in(latest);
    std::string name;
    return in >> name && name == want;
  };
  const auto until = std::chrono::steady_clock::now() + 120s;
  while ((Steps(run.Output()).size() < steps || !written()) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  EXPECT_GE(Steps(run.Output()).size(), steps) << run.Output();
  EXPECT_TRUE(written()) << latest << " never named " << want << "\n" << run.Output();
}

// Starts `meshtrain run JOB`, waits until it has printed `steps` steps, and kills one
// rank with SIGKILL; returns the run's outcome.
Outcome RunAndKillARank(const fs::path& job, size_t steps, const fs::path& log) {
  Process run({MESHTRAIN_CLI, "run", job.string(), "--sample-tokens", "0"}, {}, log);
  WaitForStepsAndTheirCheckpoint(run, job, steps);
  const std::vector<pid_t> ranks = run.Children();
  EXPECT_GE(ranks.size(), 2u);
  if (ranks.size() >= 2) ::kill(ranks[1], SIGKILL);
  return run.Wait(120s);
}

// A rank of a 4-rank run killed with SIGKILL once step 9 is done: the local gang restarts
// from the checkpoint of step 8, the run ends with status 0, and the steps after the resume
// are bitwise those of a run that was never interrupted: the same printed losses and
// norms, and after the last step the same master weights and AdamW moments, byte for byte.
// The killed job says spec.checkpoint.resume false: the restart still resumes what this
// run wrote (its checkpoints carry the run's uid).
TEST_F(WorkerTest, ARankKilledWithSigkillRestartsTheGangFromItsCheckpoint) {
  const Outcome straight = MeshtrainRun(Job("straight", 2, 2, 12));
  ASSERT_EQ(straight.status, 0) << straight.output;
  const fs::path killed_job = Job("killed", 2, 2, 12);
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(killed_job));
  manifest["spec"]["checkpoint"]["resume"] = false;
  std::ofstream(killed_job) << manifest.dump(2);
  const Outcome killed = RunAndKillARank(killed_job, 9, dir_ / "killed.log");
  ASSERT_EQ(killed.status, 0) << killed.output;
  const size_t restart = killed.output.find("failed with status 137; restarting the gang from the newest checkpoint "
                                            "(restart 1 of 3, spec.runPolicy.backoffLimit)");
  ASSERT_NE(restart, std::string::npos) << killed.output;
  ExpectResumedAtStep8AsTheStraightRun(straight.output, killed.output.substr(restart));
  // Every bit of each rank's state after step 12: any step after the resume that computed
  // another bit (a loss, a gradient) would have left another weight or moment.
  for (int rank = 0; rank < 4; ++rank) {
    const fs::path file = fs::path("step-00000012") / train::CheckpointRankFile(rank);
    const std::string a = train::ReadCheckpointFile(dir_ / "straight-checkpoints" / file),
                      b = train::ReadCheckpointFile(dir_ / "killed-checkpoints" / file);
    EXPECT_TRUE(a == b) << file << " differs from the uninterrupted run's";
  }
}

std::string EnvironmentOf(pid_t pid, const std::string& name);

// The same through a pipeline of 2 stages (2 ranks each, 1F1B): rank 3, of stage 1, killed
// once step 9 is done. The gang restarts from step 8's checkpoint (written stage by stage),
// and the steps after it are bitwise those of the run never interrupted, as is every rank's
// state after step 12.
TEST_F(WorkerTest, APipelineStageKilledWithSigkillResumesItsGangFromTheCheckpoint) {
  auto pipelined = [&](const std::string& name) {
    const fs::path path = Job(name, 2, 2, 12);
    nlohmann::json manifest = nlohmann::json::parse(std::ifstream(path));
    manifest["spec"]["parallelism"]["pipelineParallelDegree"] = 2;
    manifest["spec"]["training"]["microBatchSize"] = 1;  // 2048 tokens in 4 micro-batches of the 2 replicas
    std::ofstream(path) << manifest.dump(2);
    return path;
  };
  const Outcome straight = MeshtrainRun(pipelined("pstraight"));
  ASSERT_EQ(straight.status, 0) << straight.output;
  EXPECT_NE(straight.output.find("| bubble by stage "), std::string::npos) << "the step lines give each stage's bubble";
  const fs::path pkilled = pipelined("pkilled");
  Process run({MESHTRAIN_CLI, "run", pkilled.string(), "--sample-tokens", "0"}, {}, dir_ / "pkilled.log");
  WaitForStepsAndTheirCheckpoint(run, pkilled, 9);
  pid_t stage1 = -1;
  for (pid_t child : run.Children())
    if (EnvironmentOf(child, "RANK") == "3") stage1 = child;
  ASSERT_GT(stage1, 0) << run.Output();
  ::kill(stage1, SIGKILL);
  const Outcome killed = run.Wait(120s);
  ASSERT_EQ(killed.status, 0) << killed.output;
  const size_t restart = killed.output.find("failed with status 137; restarting the gang from the newest checkpoint");
  ASSERT_NE(restart, std::string::npos) << killed.output;
  ExpectResumedAtStep8AsTheStraightRun(straight.output, killed.output.substr(restart));
  // Both stages wrote: replica 0 of each (ranks 0 and 2).
  for (int rank : {0, 2}) {
    const fs::path file = fs::path("step-00000012") / train::CheckpointRankFile(rank);
    const std::string a = train::ReadCheckpointFile(dir_ / "pstraight-checkpoints" / file),
                      b = train::ReadCheckpointFile(dir_ / "pkilled-checkpoints" / file);
    EXPECT_TRUE(a == b) << file << " differs from the uninterrupted run's";
  }
}

// Each rank resumes reading only its own shard's chunks, so damage to rank 1's file is
// met by rank 1 alone: the gang agrees to skip that checkpoint, names the rank (which
// says why), and every rank resumes from the older one.
TEST_F(WorkerTest, ACheckpointOneRankCannotReadIsSkippedByTheWholeGang) {
  auto sharded_job = [&](int steps) {
    const fs::path job = Job("one-rank-damage", 1, 2, steps);
    nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
    manifest["spec"]["parallelism"] = {{"hybridShardDegree", 2}};  // each rank writes and reads its own shard
    std::ofstream(job) << manifest.dump(2);
    return job;
  };
  const Outcome first = MeshtrainRun(sharded_job(12));
  ASSERT_EQ(first.status, 0) << first.output;
  const fs::path newest = dir_ / "one-rank-damage-checkpoints" / "step-00000012", file = newest / "rank-00001.bin";
  {
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(100);
    char byte = 0;
    io.read(&byte, 1);
    byte ^= 0x01;
    io.seekp(100);
    io.write(&byte, 1);
  }
  const Outcome resumed = MeshtrainRun(sharded_job(14));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("warning: skipping checkpoint " + newest.string() +
                                ": rank 1 could not read its part (its log says why)"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("rank 1: warning: skipping checkpoint " + newest.string() + ": " + file.string() +
                                ": checksum mismatch in chunk 0 of its master weights"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from step 8 ("), std::string::npos) << resumed.output;
  EXPECT_EQ(Steps(resumed.output).size(), 6u) << "steps 9 to 14";
}

// With spec.runPolicy.backoffLimit 0, the first failure ends the run with the rank's status.
TEST_F(WorkerTest, AFailedRankEndsTheRunPastTheBackoffLimit) {
  const fs::path job = Job("no-restarts", 1, 2, 100000);
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
  manifest["spec"]["runPolicy"] = {{"backoffLimit", 0}};
  std::ofstream(job) << manifest.dump(2);
  const Outcome killed = RunAndKillARank(job, 2, dir_ / "no-restarts.log");
  EXPECT_EQ(killed.status, 128 + SIGKILL) << killed.output;
  EXPECT_NE(killed.output.find("the gang failed 1 time(s); spec.runPolicy.backoffLimit is 0"), std::string::npos)
      << killed.output;
  EXPECT_EQ(killed.output.find("restarting the gang"), std::string::npos) << killed.output;
}

// What an elastic shrink does to the workers: a 4-rank gang (2 nodes) fails after step 9
// with no restart left, and the job resumes as the operator's shrunk gang runs it, on 1 node
// of 2 ranks (spec.nodes 1) with the same global batch through twice the micro-batch. The
// checkpoint of step 8 reshards from 4 shards to 2, and steps 9 to 12 give the losses of a
// 4-rank run that was never interrupted, within what the order of the gradient sums and
// the printed digits allow.
TEST_F(WorkerTest, AGangShrunkToOneNodeResumesWithTheLossesOfTheUninterruptedRun) {
  const Outcome straight = MeshtrainRun(Job("uninterrupted", 2, 2, 12));
  ASSERT_EQ(straight.status, 0) << straight.output;
  const fs::path job = Job("shrinking", 2, 2, 12);
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
  manifest["spec"]["runPolicy"] = {{"backoffLimit", 0}};
  std::ofstream(job) << manifest.dump(2);
  const Outcome lost = RunAndKillARank(job, 9, dir_ / "shrinking.log");
  ASSERT_NE(lost.status, 0) << lost.output;

  const Outcome shrunk = MeshtrainRun(Job("shrinking", 1, 2, 12));  // the same checkpoint directory
  ASSERT_EQ(shrunk.status, 0) << shrunk.output;
  EXPECT_NE(shrunk.output.find("job shrinking: 2 rank(s) on 1 node(s)"), std::string::npos) << shrunk.output;
  EXPECT_NE(shrunk.output.find("resumed from step 8 ("), std::string::npos) << shrunk.output;
  const std::vector<StepLine> want = Steps(straight.output), got = Steps(shrunk.output);
  ASSERT_EQ(want.size(), 12u) << straight.output;
  ASSERT_EQ(got.size(), 4u) << shrunk.output;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[8 + i].loss, 1e-3) << "step " << 9 + i;
    EXPECT_NEAR(got[i].norm, want[8 + i].norm, 5e-3 * want[8 + i].norm) << "step " << 9 + i;
  }
}

// The variable `name` of process `pid`'s environment, or "".
std::string EnvironmentOf(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  for (std::string entry; std::getline(in, entry, '\0');)
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  return "";
}

// The file that the environment variable `name` of process `pid` names, as this process
// opens it: a local launch hands its ranks files in memory, /proc/self/fd/N in their eyes.
fs::path FileOf(pid_t pid, const std::string& name) {
  std::string path = EnvironmentOf(pid, name);
  if (path.rfind("/proc/self/", 0) == 0) path.replace(0, 10, "/proc/" + std::to_string(pid));
  return path;
}

// While a 2-rank `meshtrain run` trains, strangers try its Store: a wrong key, no key, a
// replayed handshake, garbage, a huge length, half a message. Each is refused and logged
// by address, and the run prints the losses of a run that saw none of them.
TEST_F(WorkerTest, StrangersOnTheStoreAreRefusedAndTheRunTrainsOn) {
  const Outcome quiet = MeshtrainRun(Job("quiet", 1, 2, 12));
  ASSERT_EQ(quiet.status, 0) << quiet.output;
  Process run({MESHTRAIN_CLI, "run", Job("intruded", 1, 2, 12).string(), "--sample-tokens", "20"}, {},
              dir_ / "intruded.log");
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (Steps(run.Output()).empty() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  ASSERT_FALSE(Steps(run.Output()).empty()) << run.Output();
  const std::vector<pid_t> ranks = run.Children();
  ASSERT_EQ(ranks.size(), 2u);
  const std::string coordinator = EnvironmentOf(ranks[0], "MESHTRAIN_COORDINATOR");
  std::ifstream key_file(FileOf(ranks[0], "MESHTRAIN_STORE_KEY_FILE"), std::ios::binary);
  const std::string key((std::istreambuf_iterator<char>(key_file)), {});
  ASSERT_EQ(key.size(), 32u) << "the launch's key, used here only to record a handshake to replay";
  const size_t colon = coordinator.rfind(':');
  ASSERT_NE(colon, std::string::npos) << coordinator;
  const auto intrusions = testing::IntrudeOnStore(coordinator.substr(0, colon),
                                                  uint16_t(std::stoi(coordinator.substr(colon + 1))), key);
  ASSERT_EQ(intrusions.size(), 6u);
  for (const auto& i : intrusions) EXPECT_TRUE(i.refused) << i.what << ": " << i.detail;

  const Outcome intruded = run.Wait(120s);
  ASSERT_EQ(intruded.status, 0) << intruded.output;
  size_t refusals = 0;
  for (size_t at = 0; (at = intruded.output.find("meshtrain store: refused 127.0.0.1:", at)) != std::string::npos; ++at)
    ++refusals;
  EXPECT_EQ(refusals, 5u) << intruded.output;  // all but the half message, which hung up
  const std::vector<StepLine> want = Steps(quiet.output), got = Steps(intruded.output);
  ASSERT_EQ(got.size(), want.size()) << intruded.output;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].loss, want[i].loss) << "step " << i + 1;
    EXPECT_EQ(got[i].norm, want[i].norm) << "step " << i + 1;
  }
}

// A `meshtrain run` of `job` in which the rank `stopped` receives SIGSTOP once `steps` steps
// are printed: when the output named a rank stuck, and how long after the stop.
struct Hang {
  Outcome outcome;
  std::optional<std::chrono::milliseconds> named_after;  // from SIGSTOP to the "made no progress" line
  bool stopped_rank_outlived_the_run = false;
};

Hang RunAndStopARank(const fs::path& job, size_t steps, int stopped, const fs::path& log) {
  using Clock = std::chrono::steady_clock;
  Process run({MESHTRAIN_CLI, "run", job.string(), "--sample-tokens", "0"}, {}, log);
  WaitForStepsAndTheirCheckpoint(run, job, steps);
  pid_t rank = -1;
  for (pid_t child : run.Children())
    if (EnvironmentOf(child, "RANK") == std::to_string(stopped)) rank = child;
  EXPECT_GT(rank, 0) << "no child process with RANK=" << stopped;
  Hang hang;
  if (rank > 0) {
    ::kill(rank, SIGSTOP);
    const Clock::time_point stopped_at = Clock::now();
    const Clock::time_point until = stopped_at + 60s;
    while (run.Output().find(" made no progress for ") == std::string::npos && Clock::now() < until)
      std::this_thread::sleep_for(5ms);
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - stopped_at);
    if (Clock::now() < until) hang.named_after = waited;
  }
  hang.outcome = run.Wait(120s);
  // The launcher reaped it, or it would linger stopped, adopted by init.
  hang.stopped_rank_outlived_the_run = rank > 0 && ::kill(rank, 0) == 0;
  return hang;
}

// spec.runPolicy.hangTimeoutSeconds 3 and a rank stopped with SIGSTOP once step 9 is done
// (no checkpoint since step 8): rank 0 finds it within the timeout and names it, the gang
// restarts from step 8's checkpoint, the stopped rank takes its SIGTERM at once (SIGCONT),
// and the run ends with status 0.
constexpr auto kHangTimeout = 3s;
// Detection comes one heartbeat read (0.3 s) after the timeout, counted from the gang's
// last step; the slack covers that read and two cores busy with other tests.
constexpr auto kHangSlack = 3s;

fs::path JobWithHangTimeout(const fs::path& job) {
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
  manifest["spec"]["runPolicy"] = {{"hangTimeoutSeconds", std::chrono::seconds(kHangTimeout).count()}};
  std::ofstream(job) << manifest.dump(2);
  return job;
}

// `stage`: how the stuck rank is named beside its number ("" or " \\(stage 1 of 2\\)").
void ExpectAHangRestartedFromStep8(const Hang& hang, int stuck, const std::string& why, const std::string& stage = "") {
  const std::string& output = hang.outcome.output;
  EXPECT_EQ(hang.outcome.status, 0) << output;
  ASSERT_TRUE(hang.named_after) << output;
  EXPECT_GE(*hang.named_after, kHangTimeout - 1s) << output;
  EXPECT_LE(*hang.named_after, kHangTimeout + kHangSlack) << output;
  const std::regex named("rank [0-9]+: error: rank " + std::to_string(stuck) + stage + " made no progress for [0-9.]+ s \\(" +
                         why + "\\); ending this attempt\n");
  EXPECT_TRUE(std::regex_search(output, named)) << output;
  const size_t restart = output.find("failed with status 75 (it found a hang: the stuck rank is named above); "
                                     "restarting the gang from the newest checkpoint (restart 1 of 3,");
  ASSERT_NE(restart, std::string::npos) << output;
  const std::string after = output.substr(restart);
  EXPECT_NE(after.find("resumed from step 8 ("), std::string::npos) << after;
  EXPECT_EQ(Steps(after).size(), 4u) << after;
  EXPECT_EQ(output.find("after SIGTERM; killing them"), std::string::npos) << output;
  EXPECT_FALSE(hang.stopped_rank_outlived_the_run);
}

TEST_F(WorkerTest, AStoppedRankIsNamedWithinTheHangTimeoutAndTheGangRestarts) {
  const Hang hang = RunAndStopARank(JobWithHangTimeout(Job("stopped", 2, 2, 12)), 9, 2, dir_ / "stopped.log");
  ExpectAHangRestartedFromStep8(hang, 2, "its heartbeat stopped: stopped or hung");
}

// In a pipeline of 2 stages, the stopped rank is named with its stage.
TEST_F(WorkerTest, AStoppedPipelineStageIsNamedAndTheGangRestarts) {
  const fs::path job = JobWithHangTimeout(Job("pstopped", 2, 2, 12));
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(job));
  manifest["spec"]["parallelism"]["pipelineParallelDegree"] = 2;
  manifest["spec"]["training"]["microBatchSize"] = 1;
  std::ofstream(job) << manifest.dump(2);
  const Hang hang = RunAndStopARank(job, 9, 3, dir_ / "pstopped.log");
  ExpectAHangRestartedFromStep8(hang, 3, "its heartbeat stopped: stopped or hung", " \\(stage 1 of 2\\)");
}

// Rank 0 stopped: the Store it serves stops answering, and the other ranks name it.
TEST_F(WorkerTest, AStoppedRankZeroIsNamedByTheOthersAndTheGangRestarts) {
  const Hang hang = RunAndStopARank(JobWithHangTimeout(Job("stopped0", 2, 2, 12)), 9, 0, dir_ / "stopped0.log");
  ExpectAHangRestartedFromStep8(hang, 0, "the Store it serves does not answer: stopped or hung");
}

TEST_F(WorkerTest, AMissingDataFileIsAConfigurationErrorNamingTheFile) {
  nlohmann::json job = nlohmann::json::parse(std::ifstream(Job("nodata", 1, 2, 3)));
  job["spec"]["data"]["train"] = (dir_ / "missing.bin").string();
  std::ofstream(dir_ / "nodata.json") << job.dump();
  const Outcome run = MeshtrainRun(dir_ / "nodata.json");
  EXPECT_EQ(run.status, 78) << run.output;  // EX_CONFIG: the operator fails such a job at once
  EXPECT_NE(run.output.find("configuration error"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("missing.bin"), std::string::npos) << run.output;
}

TEST_F(WorkerTest, LaunchWithoutTheWorkerEnvironmentNamesTheVariable) {
  Process p({MESHTRAIN_WORKER, "launch"}, {}, dir_ / "bare.log");
  const Outcome run = p.Wait(20s);
  EXPECT_EQ(run.status, 78) << run.output;
  EXPECT_NE(run.output.find("MESHTRAIN_NODE_RANK"), std::string::npos) << run.output;
}

TEST_F(WorkerTest, LaunchServesMetricsAndPassesSigtermToItsRanks) {
  auto env = PodEnvironment(Job("metrics", 1, 2, 100000), 2);
  const int metrics_port = launch::FreeLoopbackPort();
  env["MESHTRAIN_METRICS_PORT"] = std::to_string(metrics_port);
  env["MESHTRAIN_POD_IP"] = "127.0.0.1";
  Process launcher({MESHTRAIN_WORKER, "launch"}, env, dir_ / "launch.log");

  // Local rank 0 serves its progress once a step or two have run.
  web::http::client::http_client_config config;
  config.set_timeout(std::chrono::seconds(2));
  web::http::client::http_client http("http://127.0.0.1:" + std::to_string(metrics_port), config);
  std::string metrics;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < until) {
    try {
      auto response = http.request(web::http::methods::GET, "/metrics").get();
      metrics = response.extract_utf8string(true).get();
      if (std::regex_search(metrics, std::regex(R"(meshtrain_train_step\{[^}]*\} [1-9])"))) break;
    } catch (const std::exception&) {
    }
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_train_step\{job_name="metrics",rank="0"\} [1-9])")))
      << metrics << launcher.Output();
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_train_steps\{[^}]*\} 100000)"))) << metrics;
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_train_tokens_per_step\{[^}]*\} 2048)"))) << metrics;
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_memory_peak_bytes\{[^}]*category="params"[^}]*\} [1-9])")))
      << metrics;
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_train_loss\{[^}]*\} [2-6]\.)"))) << metrics;
  // Two ranks shard the model by default (hybridShardDegree 0): they gather and reduce-scatter.
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_memory_peak_bytes\{[^}]*category="gathered"[^}]*\} [1-9])")))
      << metrics;
  for (const char* op : {"all_gather", "reduce_scatter"}) {
    EXPECT_TRUE(std::regex_search(
        metrics, std::regex(std::string(R"(meshtrain_comm_seconds_total\{[^}]*op=")") + op + R"("[^}]*\} [0-9.e-]*[1-9])")))
        << op << "\n" << metrics;
  }
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(meshtrain_comm_exposed_seconds_total\{[^}]*\} )"))) << metrics;

  const std::vector<pid_t> ranks = launcher.Children();
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(launcher.pid(), SIGTERM);
  const Outcome run = launcher.Wait(30s);
  EXPECT_EQ(run.status, 128 + SIGTERM) << run.output;
  EXPECT_NE(run.output.find("received signal 15; passing it to 2 rank(s)"), std::string::npos) << run.output;
  for (pid_t rank : ranks) EXPECT_NE(::kill(rank, 0), 0) << "rank process " << rank << " outlived its launcher";
}

// `meshtrain run` sent SIGTERM passes it to its ranks, which end with it, and does not
// restart the gang. The rank table and the Store key it handed them were in memory only.
TEST_F(WorkerTest, MeshtrainRunPassesSigtermToItsRanksAndDoesNotRestart) {
  Process run({MESHTRAIN_CLI, "run", Job("stopped", 1, 2, 100000).string(), "--sample-tokens", "0"}, {},
              dir_ / "stopped.log");
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (Steps(run.Output()).size() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  ASSERT_GE(Steps(run.Output()).size(), 2u) << run.Output();
  const std::vector<pid_t> ranks = run.Children();
  ASSERT_EQ(ranks.size(), 2u);
  for (const char* file : {"MESHTRAIN_RANK_TABLE", "MESHTRAIN_STORE_KEY_FILE", "MESHTRAIN_FAILURE_FILE"}) {
    const std::string path = EnvironmentOf(ranks[0], file);
    EXPECT_EQ(path.rfind("/proc/self/fd/", 0), 0u) << file << "=" << path;
    EXPECT_NE(fs::read_symlink(FileOf(ranks[0], file)).string().find("/memfd:meshtrain-"), std::string::npos) << file;
  }
  std::ifstream table(FileOf(ranks[0], "MESHTRAIN_RANK_TABLE"));
  EXPECT_TRUE(nlohmann::json::parse(table, nullptr, false).contains("nodes")) << "the rank table, read as the rank does";

  ::kill(run.pid(), SIGTERM);
  const Outcome stopped = run.Wait(30s);
  EXPECT_EQ(stopped.status, 128 + SIGTERM) << stopped.output;
  EXPECT_NE(stopped.output.find("received signal 15; passing it to 2 rank(s)"), std::string::npos) << stopped.output;
  EXPECT_NE(stopped.output.find("stopped by signal 15"), std::string::npos) << stopped.output;
  EXPECT_EQ(stopped.output.find("restarting the gang"), std::string::npos) << stopped.output;
  for (pid_t rank : ranks) EXPECT_NE(::kill(rank, 0), 0) << "rank process " << rank << " outlived meshtrain run";
}

TEST_F(WorkerTest, OneDeadRankTearsDownTheOthersAndFailsThePod) {
  Process launcher({MESHTRAIN_WORKER, "launch"}, PodEnvironment(Job("kill", 1, 2, 100000), 2), dir_ / "kill.log");
  std::vector<pid_t> ranks;
  for (int i = 0; i < 100 && ranks.size() < 2; ++i) {
    std::this_thread::sleep_for(50ms);
    ranks = launcher.Children();
  }
  ASSERT_EQ(ranks.size(), 2u);
  std::this_thread::sleep_for(1s);  // let them connect and train
  ::kill(ranks[1], SIGKILL);
  const Outcome run = launcher.Wait(60s);
  EXPECT_EQ(run.status, 128 + SIGKILL) << run.output;
  EXPECT_NE(run.output.find("rank 1 failed with status 137; stopping the other ranks"), std::string::npos)
      << run.output;
  EXPECT_NE(::kill(ranks[0], 0), 0) << "rank 0 outlived the gang";
}

}  // namespace
}  // namespace meshtrain
