#include "operator/controller/launcher_client.h"

#include <cpprest/uri_builder.h>

#include "operator/controller/builders.h"

namespace meshtrain::controller {

std::string LauncherCallTarget(const LauncherCall& call) {
  web::uri_builder target("/attempt/" + call.action);
  target.append_query("attempt", std::to_string(call.attempt));
  target.append_query("token", LauncherToken(call.pod));
  return target.to_string();
}

}  // namespace meshtrain::controller
