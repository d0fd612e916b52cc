// A cuBLAS call's status as an absl::Status (what names the call).
#pragma once

#include <cublas_v2.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace exl3::engine::cuda {

inline absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", static_cast<int>(s)));
}

}  // namespace exl3::engine::cuda
