// Asserting on error messages: every bad input must name what was wrong.
#pragma once
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

namespace shardtrain::testing {

// Expects `fn` to throw E whose message contains every one of `parts`.
template <typename E, typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    FAIL() << "no exception thrown";
  } catch (const E& e) {
    const std::string message = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos)
          << "message \"" << message << "\" lacks \"" << part << "\"";
  }
}

}  // namespace shardtrain::testing
