#include "operator/kube/leader_election.h"

#include "operator/kube/time.h"

#include <condition_variable>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

namespace meshtrain::kube {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

LeaderElector::LeaderElector(Client& client, LeaderElectionOptions options) : client_(client), options_(options) {}

bool LeaderElector::TryAcquireOrRenew() {
  const auto& leases = resources::Leases();
  const std::string now = MicroTimeNow();
  const int duration_s = static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(options_.lease_duration).count());
  json lease;
  try {
    lease = client_.Get(leases, options_.namespace_, options_.name);
  } catch (const KubeError& e) {
    if (e.kind() != ErrorKind::kNotFound) throw;
    json fresh = {{"apiVersion", "coordination.k8s.io/v1"},
                  {"kind", "Lease"},
                  {"metadata", {{"name", options_.name}, {"namespace", options_.namespace_}}},
                  {"spec",
                   {{"holderIdentity", options_.identity},
                    {"leaseDurationSeconds", duration_s},
                    {"acquireTime", now},
                    {"renewTime", now},
                    {"leaseTransitions", 0}}}};
    client_.Create(leases, options_.namespace_, fresh);
    observed_ = options_.identity + "@" + now;
    observed_at_ = Clock::now();
    return true;
  }
  json& spec = lease["spec"];
  const std::string holder = spec.value("holderIdentity", "");
  const std::string record = holder + "@" + spec.value("renewTime", "");
  if (record != observed_) {
    observed_ = record;
    observed_at_ = Clock::now();
  }
  const bool held_by_me = holder == options_.identity;
  if (!held_by_me && !holder.empty()) {
    const auto lease_duration = std::chrono::seconds(spec.value("leaseDurationSeconds", duration_s));
    if (observed_at_ + lease_duration > Clock::now()) return false;  // someone else holds a live lease
  }
  if (!held_by_me) {
    spec["acquireTime"] = now;
    spec["leaseTransitions"] = spec.value("leaseTransitions", 0) + 1;
  }
  spec["holderIdentity"] = options_.identity;
  spec["leaseDurationSeconds"] = duration_s;
  spec["renewTime"] = now;
  client_.Update(leases, options_.namespace_, lease);  // conditional on resourceVersion
  observed_ = options_.identity + "@" + now;
  observed_at_ = Clock::now();
  return true;
}

void LeaderElector::Release() {
  try {
    json lease = client_.Get(resources::Leases(), options_.namespace_, options_.name);
    if (lease["spec"].value("holderIdentity", "") != options_.identity) return;
    lease["spec"]["holderIdentity"] = "";
    lease["spec"]["leaseDurationSeconds"] = 1;
    client_.Update(resources::Leases(), options_.namespace_, lease);
  } catch (const std::exception& e) {
    spdlog::warn("leader election: releasing lease {}/{}: {}", options_.namespace_, options_.name, e.what());
  }
}

bool LeaderElector::Run(std::stop_token stop, const std::function<void(std::stop_token)>& lead) {
  std::mutex mu;
  std::condition_variable_any cv;
  auto sleep = [&](std::chrono::milliseconds d) {
    std::unique_lock lock(mu);
    cv.wait_for(lock, stop, d, [] { return false; });
  };
  auto attempt = [&] {
    try {
      return TryAcquireOrRenew();
    } catch (const std::exception& e) {
      spdlog::warn("leader election: lease {}/{}: {}", options_.namespace_, options_.name, e.what());
      return false;
    }
  };
  while (!stop.stop_requested() && !attempt()) sleep(options_.retry_period);
  if (stop.stop_requested()) return false;
  spdlog::info("leader election: {} acquired lease {}/{}", options_.identity, options_.namespace_, options_.name);
  leader_ = true;

  std::stop_source leading;
  std::jthread renewer([&](std::stop_token renew_stop) {
    auto last_renew = Clock::now();
    std::mutex renew_mu;
    std::condition_variable_any renew_cv;
    while (!renew_stop.stop_requested()) {
      {
        std::unique_lock lock(renew_mu);
        renew_cv.wait_for(lock, renew_stop, options_.retry_period, [] { return false; });
      }
      if (renew_stop.stop_requested()) break;
      if (attempt()) {
        last_renew = Clock::now();
      } else if (Clock::now() - last_renew >= options_.renew_deadline) {
        spdlog::error("leader election: {} lost lease {}/{}", options_.identity, options_.namespace_, options_.name);
        leader_ = false;
        leading.request_stop();
        return;
      }
    }
  });
  std::stop_callback forward(stop, [&] { leading.request_stop(); });
  lead(leading.get_token());
  renewer.request_stop();
  renewer.join();
  if (leader_.exchange(false)) Release();
  return true;
}

}  // namespace meshtrain::kube
