// Kubernetes timestamps: metav1.Time (RFC 3339, seconds) and metav1.MicroTime.

#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace meshtrain::kube {

// "2026-11-21T20:15:35Z", UTC.
std::string Rfc3339(std::chrono::system_clock::time_point when);
std::string Rfc3339Now();
// "2026-11-21T20:15:35.123456Z", UTC.
std::string MicroTimeNow();
std::string MicroTime(std::chrono::system_clock::time_point when);
// Whole seconds from an RFC 3339 UTC timestamp to now; 0 for an empty or unreadable one.
int64_t SecondsSince(const std::string& timestamp);
int64_t SecondsSince(const std::string& timestamp, std::chrono::system_clock::time_point now);
// Seconds, with the timestamp's fraction, from a MicroTime or RFC 3339 UTC timestamp to
// `now`; nullopt for an empty or unreadable one.
std::optional<double> PreciseSecondsSince(const std::string& timestamp, std::chrono::system_clock::time_point now);

}  // namespace meshtrain::kube
