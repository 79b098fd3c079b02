// Environment variables read at run time, one reader so every variable parses and fails the same way.
// - env_*: what a user may set (README, "Environment variables"): FUSEFORGE_LCE_WORKSPACE_MIB.
// - dev_*: development knobs that force a kernel path or a tile choice, for tests and A/B timings
//   (each op's docs/design/<op>.md lists its own). They are compiled only into a developer build
//   (FUSEFORGE_DEV=1 at build time, which defines FUSEFORGE_DEV_KNOBS); in any other build they
//   return the fallback without looking at the environment. None changes results unless documented.
#pragma once
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace fuseforge {

// The variable's text, or "" when unset.
inline std::string env_string(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// A positive integer: fallback when unset or empty; a clear error for anything else.
inline int64_t env_positive_int(const char* name, int64_t fallback) {
  const std::string v = env_string(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(end != v.c_str() && *end == '\0' && parsed > 0, name, ": expected a positive integer, got '", v,
              "'");
  return static_cast<int64_t>(parsed);
}

// One of `choices`, or "" when unset or empty; a clear error ("expected a, b or c") for anything else.
inline std::string env_choice(const char* name, std::initializer_list<const char*> choices) {
  const std::string v = env_string(name);
  if (v.empty()) return v;
  std::string listed;
  size_t i = 0;
  for (const char* choice : choices) {
    if (v == choice) return v;
    listed += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + std::string(choice);
    ++i;
  }
  TORCH_CHECK(false, name, ": expected ", listed, ", got '", v, "'");
}

// A 0/1 flag: fallback when unset or empty; a clear error for anything else.
inline bool env_flag(const char* name, bool fallback) {
  const std::string v = env_choice(name, {"0", "1"});
  return v.empty() ? fallback : v == "1";
}

#ifdef FUSEFORGE_DEV_KNOBS
inline constexpr bool kDevKnobs = true;
#else
inline constexpr bool kDevKnobs = false;
#endif

// Development knobs: as env_* in a developer build; "" / the fallback otherwise.
inline std::string dev_string(const char* name) { return kDevKnobs ? env_string(name) : std::string(); }
inline int64_t dev_positive_int(const char* name, int64_t fallback) {
  return kDevKnobs ? env_positive_int(name, fallback) : fallback;
}
inline bool dev_flag(const char* name, bool fallback) { return kDevKnobs ? env_flag(name, fallback) : fallback; }
inline std::string dev_choice(const char* name, std::initializer_list<const char*> choices) {
  return kDevKnobs ? env_choice(name, choices) : std::string();
}

}  // namespace fuseforge
