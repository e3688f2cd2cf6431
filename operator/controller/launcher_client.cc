#include "operator/controller/launcher_client.h"

#include <cpprest/http_client.h>

#include "api/worker_contract.h"
#include "operator/controller/builders.h"

namespace meshtrain::controller {

using nlohmann::json;

std::vector<LauncherAnswer> SendLauncherCalls(const std::vector<LauncherCall>& calls, std::chrono::milliseconds timeout) {
  std::vector<pplx::task<LauncherAnswer>> requests;
  for (const LauncherCall& call : calls) {
    const std::string ip = call.pod.value("status", json::object()).value("podIP", "");
    if (ip.empty()) {
      requests.push_back(pplx::task_from_result(LauncherAnswer{std::nullopt, "the pod has no IP"}));
      continue;
    }
    web::http::client::http_client_config config;
    config.set_timeout(timeout);
    auto http = std::make_shared<web::http::client::http_client>(
        "http://" + ip + ":" + std::to_string(api::worker::kLauncherPort), config);
    web::uri_builder target("/attempt/" + call.action);
    target.append_query("attempt", std::to_string(call.attempt));
    target.append_query("token", LauncherToken(call.pod));
    requests.push_back(
        http->request(web::http::methods::POST, target.to_string())
            .then([http](web::http::http_response response) {
              const int code = response.status_code();
              return response.extract_utf8string(true).then([code](std::string body) {
                const json answer = json::parse(body, nullptr, false);
                if (code == web::http::status_codes::OK && answer.is_object()) return LauncherAnswer{answer, ""};
                std::string why = "HTTP " + std::to_string(code);
                if (answer.is_object() && answer.contains("error")) why += ": " + answer["error"].dump();
                return LauncherAnswer{std::nullopt, why};
              });
            })
            .then([](pplx::task<LauncherAnswer> answer) {
              try {
                return answer.get();
              } catch (const std::exception& e) {
                return LauncherAnswer{std::nullopt, e.what()};
              }
            }));
  }
  std::vector<LauncherAnswer> answers;
  for (auto& request : requests) answers.push_back(request.get());
  return answers;
}

}  // namespace meshtrain::controller
