// cpprestsdk, gtest and fmt in one translation unit: the project-wide
// _TURN_OFF_PLATFORM_STRING keeps cpprest's `U` macro from breaking the other two,
// and meshtrain::cpprest links OpenSSL for the https client.

#include <cpprest/http_client.h>
#include <cpprest/json.h>
#include <gtest/gtest.h>
#include <spdlog/fmt/fmt.h>

#ifdef U
#error "cpprestsdk's U macro leaked; _TURN_OFF_PLATFORM_STRING must be defined project-wide"
#endif

namespace {

TEST(CpprestCompat, JsonAndFmtWorkTogether) {
  const web::json::value v = web::json::value::parse(R"({"kind": "TrainingJob", "nodes": 4})");
  EXPECT_EQ(v.at("kind").as_string(), "TrainingJob");
  EXPECT_EQ(fmt::format("{} x {}", v.at("nodes").as_integer(), 8), "4 x 8");
}

TEST(CpprestCompat, HttpsClientLinks) {
  web::http::client::http_client client("https://127.0.0.1:1");  // constructed only; no request is sent
  EXPECT_EQ(client.base_uri().scheme(), "https");
}

}  // namespace
