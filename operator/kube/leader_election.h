// Leader election with a coordination.k8s.io/v1 Lease, as client-go does it.
//
// A candidate takes the lease when it does not exist, or when its holder has not
// renewed it for leaseDuration as measured by this process's own clock (so clock skew
// between replicas does not matter). The leader renews every retry period; if it cannot
// renew for renew_deadline it has lost the lease, and its leading stop_token is
// triggered at once. Updates are conditional on resourceVersion, so two candidates
// never both win.
//
// Thread-safety: Run() on one thread; IsLeader() from any.

#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <stop_token>
#include <string>

#include "operator/kube/client.h"

namespace meshtrain::kube {

struct LeaderElectionOptions {
  std::string namespace_ = "default";
  std::string name = "meshtrain-operator";
  std::string identity;  // unique per candidate, e.g. hostname_pid
  std::chrono::milliseconds lease_duration{15000};
  std::chrono::milliseconds renew_deadline{10000};
  std::chrono::milliseconds retry_period{2000};
};

class LeaderElector {
 public:
  LeaderElector(Client& client, LeaderElectionOptions options);

  // Campaigns until elected, then calls lead(leading) on this thread; `leading` is stopped
  // when the lease is lost or `stop` is requested. lead() must return promptly once
  // `leading` is stopped. Returns true if it led and lost (or was stopped) and false if
  // `stop` came before it was ever elected. On a clean stop the lease is released.
  bool Run(std::stop_token stop, const std::function<void(std::stop_token leading)>& lead);

  bool IsLeader() const { return leader_.load(); }

 private:
  // One attempt to take or renew the lease. Returns true when this candidate holds it.
  bool TryAcquireOrRenew();
  void Release();

  Client& client_;
  const LeaderElectionOptions options_;
  std::atomic<bool> leader_{false};
  std::string observed_;  // holder + renewTime last seen
  std::chrono::steady_clock::time_point observed_at_{};
};

}  // namespace meshtrain::kube
