#include "operator/controller/progress_poller.h"

#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>

#include <cpprest/http_client.h>
#include <spdlog/spdlog.h>

#include "api/worker_contract.h"

namespace meshtrain::controller {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct ProgressPoller::State {
  std::function<void(const std::string&)> changed;
  mutable std::mutex mu;
  std::condition_variable idle;  // signalled when a request ends
  bool stopped = false;
  int in_flight = 0;
  struct Target {
    std::string uid, ip;
    std::shared_ptr<web::http::client::http_client> http;
    std::optional<api::ProgressStatus> latest;
    Clock::time_point next{};
    bool in_flight = false;
  };
  std::map<std::string, Target> targets;  // job key -> its rank-0 pod
};

ProgressPoller::ProgressPoller(ProgressPollerOptions options, std::function<void(const std::string&)> changed)
    : options_(options), state_(std::make_shared<State>()) {
  state_->changed = std::move(changed);
}

ProgressPoller::~ProgressPoller() { Stop(); }

void ProgressPoller::Start() {
  {
    std::lock_guard lock(state_->mu);
    state_->stopped = false;
  }
  thread_ = std::jthread([this](std::stop_token stop) { Loop(stop); });
}

void ProgressPoller::Stop() {
  if (thread_.joinable()) {
    thread_.request_stop();
    thread_.join();
  }
  std::unique_lock lock(state_->mu);
  state_->stopped = true;
  // Each request ends within the timeout; the margin covers a busy machine.
  state_->idle.wait_for(lock, options_.timeout * 2 + std::chrono::seconds(1), [&] { return state_->in_flight == 0; });
}

void ProgressPoller::Watch(const std::string& job_key, const json& pod) {
  const std::string uid = pod["metadata"].value("uid", "");
  const std::string ip = pod.value("status", json::object()).value("podIP", "");
  std::lock_guard lock(state_->mu);
  auto& target = state_->targets[job_key];
  if (target.uid == uid && target.ip == ip) return;
  target = State::Target{uid, ip, nullptr, std::nullopt, Clock::now(), false};
  if (ip.empty()) return;
  web::http::client::http_client_config config;
  config.set_timeout(options_.timeout);
  target.http = std::make_shared<web::http::client::http_client>(
      "http://" + ip + ":" + std::to_string(api::worker::kMetricsPort), config);
}

void ProgressPoller::Forget(const std::string& job_key) {
  std::lock_guard lock(state_->mu);
  state_->targets.erase(job_key);
}

std::optional<api::ProgressStatus> ProgressPoller::Latest(const std::string& job_key, const json& pod) const {
  std::lock_guard lock(state_->mu);
  auto it = state_->targets.find(job_key);
  if (it == state_->targets.end() || it->second.uid != pod["metadata"].value("uid", "")) return std::nullopt;
  return it->second.latest;
}

void ProgressPoller::Loop(std::stop_token stop) {
  const auto tick = std::min<std::chrono::milliseconds>(options_.interval, std::chrono::milliseconds(100));
  std::mutex mu;
  std::condition_variable_any cv;
  while (!stop.stop_requested()) {
    {
      std::lock_guard lock(state_->mu);
      const auto now = Clock::now();
      for (auto& [key, target] : state_->targets) {
        if (!target.http || target.in_flight || now < target.next) continue;
        target.in_flight = true;
        target.next = now + options_.interval;
        ++state_->in_flight;
        // The request holds the state and its client, not the poller: the poller may be gone
        // when a late answer arrives, and Stop() keeps `changed` from being called then.
        std::shared_ptr<State> state = state_;
        std::shared_ptr<web::http::client::http_client> http = target.http;
        const std::string job_key = key, uid = target.uid;
        http->request(web::http::methods::GET, "/metrics")
            .then([](web::http::http_response response) {
              if (response.status_code() != web::http::status_codes::OK)
                throw std::runtime_error("HTTP " + std::to_string(response.status_code()));
              return response.extract_utf8string(true);
            })
            .then([state, http, job_key, uid](pplx::task<std::string> body) {
              std::optional<api::ProgressStatus> reading;
              try {
                api::ProgressStatus progress;
                if (ParseProgress(body.get(), &progress)) reading = progress;
              } catch (const std::exception& e) {
                spdlog::debug("{}: reading progress: {}", job_key, e.what());  // workers may not serve yet
              }
              std::lock_guard state_lock(state->mu);
              --state->in_flight;
              state->idle.notify_all();
              auto it = state->targets.find(job_key);
              if (it == state->targets.end() || it->second.uid != uid) return;  // another pod by now
              it->second.in_flight = false;
              if (!reading || reading == it->second.latest) return;
              it->second.latest = reading;
              if (!state->stopped) state->changed(job_key);
            });
      }
    }
    std::unique_lock sleep_lock(mu);
    cv.wait_for(sleep_lock, stop, tick, [] { return false; });
  }
}

bool ParseProgress(const std::string& text, api::ProgressStatus* progress) {
  namespace m = api::worker::metric;
  std::istringstream in(text);
  std::string line;
  bool any = false;
  double steps_total = 0, tokens_per_step = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string name = line.substr(0, space);
    name = name.substr(0, name.find('{'));
    double value;
    try {
      value = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
      continue;
    }
    if (name == m::kStep) progress->step = static_cast<int64_t>(value), any = true;
    else if (name == m::kLoss) progress->loss = value, any = true;
    else if (name == m::kTokensPerSecond) progress->tokens_per_second = std::round(value), any = true;
    else if (name == m::kSteps) steps_total = value;
    else if (name == m::kTokensPerStep) tokens_per_step = value;
    else if (name == m::kResumedFromStep && value >= 0) progress->resumed_from_step = static_cast<int64_t>(value);
    else if (name == m::kCheckpointLastStep && value >= 0) progress->checkpoint_step = static_cast<int64_t>(value);
    else if (name == m::kResumeDamagedCheckpoints && value > 0)
      progress->damaged_checkpoints = static_cast<int64_t>(value);
  }
  if (any && steps_total > progress->step && tokens_per_step > 0 && progress->tokens_per_second > 0)
    progress->eta_seconds =
        static_cast<int64_t>((steps_total - progress->step) * tokens_per_step / progress->tokens_per_second);
  return any;
}

}  // namespace meshtrain::controller
