// common/env.h, the one reader of environment variables: each parser returns the fallback when the
// variable is unset or empty and otherwise its value, or an error naming the variable and what it
// expected.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/env.h"
#include "testing.h"

namespace {

using fuseforge::testing::expect_error_naming;
using fuseforge::testing::ScopedEnv;

constexpr const char* kVar = "FUSEFORGE_TEST_ENV_VARIABLE";

}  // namespace

TEST(Env, ChoiceReturnsTheValueOrEmpty) {
  unsetenv(kVar);
  EXPECT_EQ(fuseforge::env_choice(kVar, {"a", "b"}), "");
  {
    ScopedEnv env(kVar, "");
    EXPECT_EQ(fuseforge::env_choice(kVar, {"a", "b"}), "");
  }
  ScopedEnv env(kVar, "b");
  EXPECT_EQ(fuseforge::env_choice(kVar, {"a", "b"}), "b");
}

TEST(Env, ChoiceNamesTheVariableAndEveryChoice) {
  ScopedEnv env(kVar, "c");
  expect_error_naming([] { fuseforge::env_choice(kVar, {"a"}); }, std::string(kVar) + ": expected a, got 'c'");
  expect_error_naming([] { fuseforge::env_choice(kVar, {"128", "192"}); },
                      std::string(kVar) + ": expected 128 or 192, got 'c'");
  expect_error_naming([] { fuseforge::env_choice(kVar, {"token", "staged", "register"}); },
                      std::string(kVar) + ": expected token, staged or register, got 'c'");
}

TEST(Env, FlagAndPositiveInt) {
  unsetenv(kVar);
  EXPECT_TRUE(fuseforge::env_flag(kVar, true));
  EXPECT_FALSE(fuseforge::env_flag(kVar, false));
  EXPECT_EQ(fuseforge::env_positive_int(kVar, 7), 7);
  {
    ScopedEnv env(kVar, "1");
    EXPECT_TRUE(fuseforge::env_flag(kVar, false));
  }
  {
    ScopedEnv env(kVar, "0");
    EXPECT_FALSE(fuseforge::env_flag(kVar, true));
    expect_error_naming([] { fuseforge::env_positive_int(kVar, 7); },
                        std::string(kVar) + ": expected a positive integer, got '0'");
  }
  ScopedEnv env(kVar, "yes");
  expect_error_naming([] { fuseforge::env_flag(kVar, false); }, std::string(kVar) + ": expected 0 or 1, got 'yes'");
}

TEST(Env, DevKnobsReadTheEnvironmentOnlyInADeveloperBuild) {
  ScopedEnv env(kVar, "b");
  const std::string seen = fuseforge::kDevKnobs ? "b" : "";
  EXPECT_EQ(fuseforge::dev_choice(kVar, {"a", "b"}), seen);
  EXPECT_EQ(fuseforge::dev_string(kVar), seen);
}
