// Errors that diffuserve reports to its callers. Every failure caused by input (a
// checkpoint, a token id, a parameter) is one of these, never a crash.
#pragma once

#include "diffuserve/abi.h"

#include <stdexcept>
#include <string>

namespace diffuserve {

// A caller passed a value that is out of range or inconsistent (Python: ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A file on disk is malformed or does not match what the model needs; the message names
// the file and, where there is one, the tensor (Python: diffuserve.CheckpointError). A NUL
// in the message (a name read from the file may hold one) is written \0: what() ends at the
// first, and Python's message and a C++ caller's print had ended there.
class FormatError : public std::runtime_error {
 public:
  explicit FormatError(const std::string& message) : std::runtime_error(without_nul(message)) {}

 private:
  static std::string without_nul(const std::string& message) {
    std::string out;
    for (char c : message) {
      if (c) out += c;
      else out += "\\0";
    }
    return out;
  }
};

// A call that the caller stopped, through the std::stop_token it passed, before it finished
// (generate()): what it held is freed, and the model goes on serving other calls.
class Cancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace diffuserve
