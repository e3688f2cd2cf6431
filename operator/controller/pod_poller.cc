#include "operator/controller/pod_poller.h"

#include <algorithm>
#include <condition_variable>
#include <tuple>
#include <map>
#include <mutex>

#include <cpprest/http_client.h>
#include <spdlog/spdlog.h>

#include "operator/kube/objects.h"

namespace meshtrain::controller {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string Ip(const json& pod) { return pod.value("status", json::object()).value("podIP", ""); }

}  // namespace

struct PodPoller::State {
  Parse parse;
  std::function<void(const std::string&)> changed;
  mutable std::mutex mu;
  std::condition_variable idle;  // signalled when a request ends
  bool stopped = false;
  int in_flight = 0;       // requests, GETs and POSTs
  int gets_in_flight = 0;
  struct Target {
    std::string ip;
    std::shared_ptr<web::http::client::http_client> http;
    std::optional<json> latest;
    Clock::time_point next{};
    int failures = 0;        // reads failed in a row
    bool in_flight = false;  // a GET
    bool posting = false;    // a POST
  };
  std::map<std::string, std::map<std::string, Target>> jobs;  // job key -> pod uid -> target

  // Counts a request as ended; returns its pod's target, or null when the pod is no
  // longer watched. REQUIRES: mu held.
  Target* Ended(const std::string& job_key, const std::string& uid) {
    --in_flight;
    idle.notify_all();
    auto job = jobs.find(job_key);
    if (job == jobs.end()) return nullptr;
    auto it = job->second.find(uid);
    return it == job->second.end() ? nullptr : &it->second;
  }
};

PodPoller::PodPoller(PodPollerOptions options, Parse parse, std::function<void(const std::string&)> changed)
    : options_(std::move(options)), state_(std::make_shared<State>()) {
  state_->parse = std::move(parse);
  state_->changed = std::move(changed);
}

PodPoller::~PodPoller() { Stop(); }

void PodPoller::Start() {
  {
    std::lock_guard lock(state_->mu);
    state_->stopped = false;
  }
  thread_ = std::jthread([this](std::stop_token stop) { Loop(stop); });
}

void PodPoller::Stop() {
  if (thread_.joinable()) {
    thread_.request_stop();
    thread_.join();
  }
  std::unique_lock lock(state_->mu);
  state_->stopped = true;
  // Each request ends within the timeout; the margin covers a busy machine.
  state_->idle.wait_for(lock, options_.timeout * 2 + std::chrono::seconds(1), [&] { return state_->in_flight == 0; });
}

void PodPoller::Watch(const std::string& job_key, const std::vector<json>& pods) {
  std::lock_guard lock(state_->mu);
  std::map<std::string, State::Target>& targets = state_->jobs[job_key];
  std::map<std::string, State::Target> watched;
  for (const json& pod : pods) {
    const std::string uid = kube::Uid(pod), ip = Ip(pod);
    if (auto it = targets.find(uid); it != targets.end() && it->second.ip == ip) {
      watched[uid] = std::move(it->second);
      continue;
    }
    State::Target& target = watched[uid];
    target.ip = ip;
    target.next = Clock::now();
    if (ip.empty()) continue;
    web::http::client::http_client_config config;
    config.set_timeout(options_.timeout);
    target.http = std::make_shared<web::http::client::http_client>("http://" + ip + ":" + std::to_string(options_.port),
                                                                   config);
  }
  targets = std::move(watched);
}

void PodPoller::Forget(const std::string& job_key) {
  std::lock_guard lock(state_->mu);
  state_->jobs.erase(job_key);
}

std::optional<json> PodPoller::Latest(const std::string& job_key, const json& pod) const {
  std::lock_guard lock(state_->mu);
  auto job = state_->jobs.find(job_key);
  if (job == state_->jobs.end()) return std::nullopt;
  auto it = job->second.find(kube::Uid(pod));
  if (it == job->second.end()) return std::nullopt;
  return it->second.latest;
}

void PodPoller::Post(const std::string& job_key, const json& pod, const std::string& target) {
  std::lock_guard lock(state_->mu);
  auto job = state_->jobs.find(job_key);
  if (job == state_->jobs.end()) return;
  auto it = job->second.find(kube::Uid(pod));
  if (it == job->second.end() || !it->second.http || it->second.posting) return;
  it->second.posting = true;
  ++state_->in_flight;
  std::shared_ptr<State> state = state_;
  std::shared_ptr<web::http::client::http_client> http = it->second.http;
  const std::string uid = it->first, path = target.substr(0, target.find('?'));
  http->request(web::http::methods::POST, target)
      .then([](web::http::http_response response) { return response.extract_utf8string(true); })
      .then([state, http, job_key, uid, path](pplx::task<std::string> body) {
        std::optional<json> reading;
        try {
          const std::string text = body.get();
          reading = state->parse(text);
          if (!reading) spdlog::warn("{}: POST {} to pod {}: {}", job_key, path, uid, text);
        } catch (const std::exception& e) {
          spdlog::warn("{}: POST {} to pod {}: {}", job_key, path, uid, e.what());
        }
        std::lock_guard state_lock(state->mu);
        auto* posted = state->Ended(job_key, uid);
        if (!posted) return;
        posted->posting = false;
        if (!reading) return;
        posted->latest = std::move(reading);
        if (!state->stopped) state->changed(job_key);
      });
}

void PodPoller::Loop(std::stop_token stop) {
  const auto tick = std::min<std::chrono::milliseconds>(options_.interval, std::chrono::milliseconds(100));
  std::mutex mu;
  std::condition_variable_any cv;
  while (!stop.stop_requested()) {
    {
      std::lock_guard lock(state_->mu);
      const auto now = Clock::now();
      // The pods due, as far as the bound allows: those that answered their last read
      // first (fewest failures in a row), then the longest due.
      std::vector<std::tuple<int, Clock::time_point, const std::string*, const std::string*, State::Target*>> due;
      for (auto& [key, targets] : state_->jobs) {
        for (auto& [pod_uid, target] : targets) {
          if (target.http && !target.in_flight && now >= target.next)
            due.emplace_back(target.failures, target.next, &key, &pod_uid, &target);
        }
      }
      const size_t slots = size_t(std::max(0, options_.max_in_flight - state_->gets_in_flight));
      if (due.size() > slots) {
        std::partial_sort(due.begin(), due.begin() + std::ptrdiff_t(slots), due.end(), [](const auto& a, const auto& b) {
          return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
        });
        due.resize(slots);
      }
      for (auto& [failures, next, key, pod_uid, target] : due) {
        target->in_flight = true;
        target->next = now + options_.interval;
        ++state_->in_flight;
        ++state_->gets_in_flight;
        // The request holds the state and its client, not the poller: the poller may be
        // gone when a late answer arrives, and Stop() keeps `changed` from being called then.
        std::shared_ptr<State> state = state_;
        std::shared_ptr<web::http::client::http_client> http = target->http;
        const std::string job_key = *key, uid = *pod_uid;
        const auto interval = options_.interval, max_backoff = options_.max_backoff;
        http->request(web::http::methods::GET, options_.path)
            .then([](web::http::http_response response) {
              if (response.status_code() != web::http::status_codes::OK)
                throw std::runtime_error("HTTP " + std::to_string(response.status_code()));
              return response.extract_utf8string(true);
            })
            .then([state, http, job_key, uid, interval, max_backoff](pplx::task<std::string> body) {
              std::optional<json> reading;
              bool answered = false;
              try {
                reading = state->parse(body.get());
                answered = true;
              } catch (const std::exception& e) {
                spdlog::debug("{}: reading pod {}: {}", job_key, uid, e.what());  // it may not serve yet
              }
              std::lock_guard state_lock(state->mu);
              --state->gets_in_flight;
              auto* read = state->Ended(job_key, uid);
              if (!read) return;
              read->in_flight = false;
              if (answered) {
                read->failures = 0;
              } else {
                // A pod that stopped answering no longer vouches for its last reading, and
                // is read less often until it answers again.
                read->latest.reset();
                read->failures = std::min(read->failures + 1, 20);
                const auto backoff = std::min<Clock::duration>(interval * (int64_t{1} << std::min(read->failures, 16)),
                                                               max_backoff);
                read->next = std::max(read->next, Clock::now() + backoff);
              }
              if (!reading || reading == read->latest) return;
              read->latest = std::move(reading);
              if (!state->stopped) state->changed(job_key);
            });
      }
    }
    std::unique_lock sleep_lock(mu);
    cv.wait_for(sleep_lock, stop, tick, [] { return false; });
  }
}

}  // namespace meshtrain::controller
