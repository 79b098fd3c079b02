// Development knobs read from the environment (each op's docs/design/<op>.md lists its knobs; none
// changes results unless documented there). One reader so every knob parses and fails the same way.
#pragma once
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace fuseforge {

// The variable's text, or "" when unset.
inline std::string env_string(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// A positive integer knob: fallback when unset or empty; a clear error for anything else.
inline int64_t env_positive_int(const char* name, int64_t fallback) {
  const std::string v = env_string(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(end != v.c_str() && *end == '\0' && parsed > 0, name, ": expected a positive integer, got '", v,
              "'");
  return static_cast<int64_t>(parsed);
}

// A 0/1 knob: fallback when unset or empty; a clear error for anything else.
inline bool env_flag(const char* name, bool fallback) {
  const std::string v = env_string(name);
  if (v.empty()) return fallback;
  TORCH_CHECK(v == "0" || v == "1", name, ": expected 0 or 1, got '", v, "'");
  return v == "1";
}

}  // namespace fuseforge
