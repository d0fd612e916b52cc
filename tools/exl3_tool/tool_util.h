// Small helpers shared by exl3-tool subcommands: a flag parser local to one subcommand (absl flags
// are process-global, and the subcommands of one binary reuse names such as --model), the
// --backend choice, and reading an input tensor as fp32.
//
// Usage:
//   ToolArgs args;
//   std::string err;
//   if (!args.Parse(argc, argv, {"model", "layer"}, {"inner"}, &err)) return Fail("moe", err);
//   if (args.help) { std::printf("%s", kUsage); return 0; }
//   std::string dir = args.Get("model");
#pragma once

#ifdef EXL3_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "model/safetensors.h"

namespace exl3::tool {

class ToolArgs {
 public:
  bool help = false;

  // argv[0] is the subcommand name. Accepts --name value, --name=value, and bare --flag for the
  // boolean ones. Unknown flags, missing values, repeats and positional arguments are errors.
  bool Parse(int argc, char** argv, const std::set<std::string>& value_flags,
             const std::set<std::string>& bool_flags, std::string* error) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h" || a == "--helpfull") {
        help = true;
        continue;
      }
      if (a.rfind("--", 0) != 0) {
        *error = absl::StrCat("unexpected argument '", a, "' (see --help)");
        return false;
      }
      a = a.substr(2);
      std::string value;
      bool has_value = false;
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        has_value = true;
      }
      if (values_.count(a) || bools_.count(a)) {
        *error = absl::StrCat("--", a, " given twice");
        return false;
      }
      if (bool_flags.count(a)) {
        if (has_value && value != "true" && value != "false") {
          *error = absl::StrCat("--", a, " takes no value");
          return false;
        }
        bools_[a] = !has_value || value == "true";
        continue;
      }
      if (!value_flags.count(a)) {
        *error = absl::StrCat("unknown flag --", a, " (see --help)");
        return false;
      }
      if (!has_value) {
        if (i + 1 >= argc) {
          *error = absl::StrCat("--", a, " needs a value");
          return false;
        }
        value = argv[++i];
      }
      values_[a] = value;
    }
    return true;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& def = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? def : it->second;
  }
  bool Bool(const std::string& name) const {
    auto it = bools_.find(name);
    return it != bools_.end() && it->second;
  }
  // Requires the listed value flags; sets *error naming the first one missing.
  bool Require(const std::vector<std::string>& names, std::string* error) const {
    for (const auto& n : names) {
      if (!Has(n) || Get(n).empty()) {
        *error = absl::StrCat("--", n, " is required (see --help)");
        return false;
      }
    }
    return true;
  }
  bool GetInt(const std::string& name, int* out, std::string* error) const {
    if (!absl::SimpleAtoi(Get(name), out)) {
      *error = absl::StrCat("--", name, " must be an integer, got '", Get(name), "'");
      return false;
    }
    return true;
  }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> bools_;
};

// Compute backends a subcommand can run on. kCuda is accepted only where the build has it.
enum class ToolBackend { kCpu, kCuda };

inline bool CudaBackendCompiled() {
#if defined(EXL3_HAVE_CUDA_BACKEND) || defined(EXL3_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

// Compiled in and a device present (auto picks cuda only then; CI builds CUDA without a GPU).
inline bool CudaBackendUsable() {
#ifdef EXL3_HAVE_CUDA
  return cuda::DeviceCount() > 0;
#else
  return false;
#endif
}

// "cpu", "cuda" or "auto" (cuda when compiled in, else cpu).
inline bool ParseBackend(const std::string& s, ToolBackend* out, std::string* error) {
  if (s == "cpu") {
    *out = ToolBackend::kCpu;
  } else if (s == "cuda") {
    if (!CudaBackendCompiled()) {
      *error = "--backend cuda: this build has no CUDA backend (use cpu or auto)";
      return false;
    }
    *out = ToolBackend::kCuda;
  } else if (s == "auto" || s.empty()) {
    *out = CudaBackendUsable() ? ToolBackend::kCuda : ToolBackend::kCpu;
  } else {
    *error = absl::StrCat("--backend must be cpu, cuda or auto, got '", s, "'");
    return false;
  }
  return true;
}

// Reads tensor `name` of a safetensors file as fp32 (F16, BF16, F32 or F64), with its shape.
inline absl::StatusOr<std::vector<float>> ReadFloatTensor(const std::string& path,
                                                          const std::string& name,
                                                          std::vector<int64_t>* shape) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  if (!f.ok()) return f.status();
  absl::StatusOr<TensorView> t = (*f)->Get(name);
  if (!t.ok()) return t.status();
  if (t->info->dtype != DType::kF16 && t->info->dtype != DType::kBF16 &&
      t->info->dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' has dtype ",
                                                   std::string(DTypeName(t->info->dtype)),
                                                   ", expected F16, BF16 or F32"));
  }
  *shape = t->info->shape;
  return ToFloat32(*t);
}

}  // namespace exl3::tool
