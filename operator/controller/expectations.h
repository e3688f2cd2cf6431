// What the operator has written and its pod cache has not shown yet, per job: the
// expectations of controller-runtime and of Kubernetes' Job controller. Each pod the
// operator creates is expected to appear in the cache (by name), each it deletes to leave
// it (by uid). Until they have, the cache is older than the operator's own writes: a pod
// missing from it may be one just created, and a pod still in it one just deleted. The
// reconciler then waits for the cache rather than judge the job from it.
//
// The pod informer's events lower the expectations (Seen, Gone), after the cache changed.
// So a reconcile reads the outstanding expectations first (Outstanding) and the cache
// after: whatever is no longer expected by then is in the cache it reads, and whatever
// still is, it compares with what it reads. An expectation older than the timeout is
// dropped: a pod created and deleted between two lists of a relisting informer never
// shows. Past that, the reconciler acts without waiting, but reads the API server before
// any decision that a missing pod or node would justify (reconciler.h).
//
// Thread-safety: every method may be called from any thread.

#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

class Expectations {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Expectations(Clock::duration timeout) : timeout_(timeout) {}

  // Before creating these pods (names) or deleting these (uids) of `job`.
  void ExpectCreations(const std::string& job, const std::vector<std::string>& names, Clock::time_point now);
  void ExpectDeletions(const std::string& job, const std::vector<std::string>& uids, Clock::time_point now);
  // A create that did not happen (it failed), or a delete of a pod already gone (404).
  void CreationFailed(const std::string& job, const std::string& name);
  void DeletionFailed(const std::string& job, const std::string& uid);

  // The informer's events, once the cache shows them: pod `name` is in it; pod `uid` left it.
  void Seen(const std::string& job, const std::string& name);
  void Gone(const std::string& job, const std::string& uid);

  struct Pending {
    std::set<std::string> creations;  // pod names the cache had not shown
    std::set<std::string> deletions;  // uids of pods the cache still showed
    bool empty() const { return creations.empty() && deletions.empty(); }
  };
  // What the cache has not shown yet of `job`'s creates and deletes, less what waited past
  // the timeout (dropped). Read it before the cache.
  Pending Outstanding(const std::string& job, Clock::time_point now);

  void Forget(const std::string& job);

 private:
  struct Job {
    std::map<std::string, Clock::time_point> creations;  // name -> since
    std::map<std::string, Clock::time_point> deletions;  // uid -> since
  };
  const Clock::duration timeout_;
  std::mutex mu_;
  std::map<std::string, Job> jobs_;
};

}  // namespace meshtrain::controller
