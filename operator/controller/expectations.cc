#include "operator/controller/expectations.h"

#include <spdlog/spdlog.h>


namespace meshtrain::controller {

void Expectations::ExpectCreations(const std::string& job, const std::vector<std::string>& names, Clock::time_point now) {
  if (names.empty()) return;
  std::lock_guard lock(mu_);
  for (const std::string& name : names) jobs_[job].creations[name] = now;
}

void Expectations::ExpectDeletions(const std::string& job, const std::vector<std::string>& uids, Clock::time_point now) {
  if (uids.empty()) return;
  std::lock_guard lock(mu_);
  for (const std::string& uid : uids) jobs_[job].deletions[uid] = now;
}

void Expectations::CreationFailed(const std::string& job, const std::string& name) {
  std::lock_guard lock(mu_);
  if (auto it = jobs_.find(job); it != jobs_.end()) it->second.creations.erase(name);
}

void Expectations::DeletionFailed(const std::string& job, const std::string& uid) { Gone(job, uid); }

void Expectations::Seen(const std::string& job, const std::string& name) { CreationFailed(job, name); }

void Expectations::Gone(const std::string& job, const std::string& uid) {
  std::lock_guard lock(mu_);
  if (auto it = jobs_.find(job); it != jobs_.end()) it->second.deletions.erase(uid);
}

Expectations::Pending Expectations::Outstanding(const std::string& job, Clock::time_point now) {
  Pending left;
  std::lock_guard lock(mu_);
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return left;
  auto keep = [&](std::map<std::string, Clock::time_point>& expected, std::set<std::string>* out, const char* what) {
    for (auto e = expected.begin(); e != expected.end();) {
      if (now - e->second <= timeout_) {
        out->insert(e->first);
        ++e;
        continue;
      }
      spdlog::warn("{}: the pod cache never showed the {} of pod {} ({} s ago); no longer waiting for it", job, what,
                   e->first, std::chrono::duration_cast<std::chrono::seconds>(now - e->second).count());
      e = expected.erase(e);
    }
  };
  keep(it->second.creations, &left.creations, "create");
  keep(it->second.deletions, &left.deletions, "delete");
  if (left.empty()) jobs_.erase(it);
  return left;
}

void Expectations::Forget(const std::string& job) {
  std::lock_guard lock(mu_);
  jobs_.erase(job);
}

}  // namespace meshtrain::controller
