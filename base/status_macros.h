// The project's one pair of status macros, for code that returns absl::Status / absl::StatusOr.
//
//   EXL3_RETURN_IF_ERROR(w.Open(path));                 // returns the error, if any
//   EXL3_ASSIGN_OR_RETURN(auto cfg, LoadConfig(dir));   // declares cfg, or returns the error
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define EXL3_RETURN_IF_ERROR(expr)          \
  do {                                      \
    const ::absl::Status exl3_st_ = (expr); \
    if (!exl3_st_.ok()) return exl3_st_;    \
  } while (0)

#define EXL3_STATUS_CONCAT_INNER_(a, b) a##b
#define EXL3_STATUS_CONCAT_(a, b) EXL3_STATUS_CONCAT_INNER_(a, b)

#define EXL3_ASSIGN_OR_RETURN(lhs, expr) \
  EXL3_ASSIGN_OR_RETURN_IMPL_(EXL3_STATUS_CONCAT_(exl3_statusor_, __LINE__), lhs, expr)

#define EXL3_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()
