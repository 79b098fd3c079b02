// Helpers shared by the C++ tests: an environment variable set for one scope, and the check that a
// call stops with an error whose message names the problem.
#pragma once
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace fuseforge::testing {

// Sets a variable for one scope and unsets it after, also when a failed check returns early.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* name_, const char* value) : name(name_) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

// Runs `call` and expects it to stop with a c10::Error whose message contains `message`.
template <class Call>
void expect_error_naming(const Call& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "expected an error naming: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

}  // namespace fuseforge::testing
