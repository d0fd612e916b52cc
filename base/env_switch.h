// Switches read from the environment for A/B measurements: on unless the variable is "0".
// Callers keep the value in a function-local static, so each is read once.
//
//   static const bool pdl = exl3::EnvSwitchOn("EXL3_PDL");
#pragma once

#include <cstdlib>
#include <cstring>

namespace exl3 {

inline bool EnvSwitchOn(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

}  // namespace exl3
