#include "operator/kube/time.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace meshtrain::kube {
namespace {

std::string Format(std::chrono::system_clock::time_point when, bool micros) {
  const std::time_t t = std::chrono::system_clock::to_time_t(when);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec);
  std::string out = buf;
  if (micros) {
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(when.time_since_epoch()).count() % 1000000;
    std::snprintf(buf, sizeof buf, ".%06d", static_cast<int>(us));
    out += buf;
  }
  return out + "Z";
}

}  // namespace

std::string Rfc3339(std::chrono::system_clock::time_point when) { return Format(when, false); }

std::string Rfc3339Now() { return Rfc3339(std::chrono::system_clock::now()); }

std::string MicroTimeNow() { return MicroTime(std::chrono::system_clock::now()); }

std::string MicroTime(std::chrono::system_clock::time_point when) { return Format(when, true); }

int64_t SecondsSince(const std::string& timestamp, std::chrono::system_clock::time_point now) {
  std::tm tm{};
  if (timestamp.empty() || !strptime(timestamp.c_str(), "%Y-%m-%dT%H:%M:%S", &tm)) return 0;
  return std::chrono::system_clock::to_time_t(now) - timegm(&tm);
}

std::optional<double> PreciseSecondsSince(const std::string& timestamp, std::chrono::system_clock::time_point now) {
  std::tm tm{};
  const char* rest = timestamp.empty() ? nullptr : strptime(timestamp.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  if (rest == nullptr) return std::nullopt;
  double fraction = 0;
  if (*rest == '.') fraction = std::strtod(rest, nullptr);  // ".123456Z" reads as 0.123456
  const auto since = now - std::chrono::system_clock::from_time_t(timegm(&tm));
  return std::chrono::duration<double>(since).count() - fraction;
}

int64_t SecondsSince(const std::string& timestamp) { return SecondsSince(timestamp, std::chrono::system_clock::now()); }

}  // namespace meshtrain::kube
