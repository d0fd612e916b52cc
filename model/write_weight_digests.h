// Records the content digests of a model directory's tensors (model/weight_digest.h). The writer
// reads the tensors through a TensorSource (model/safetensors.h), which includes the digests'
// header to check what it reads: the writer lives apart so the two pairs do not include each other.
//
//   EXL3_RETURN_IF_ERROR(WriteWeightDigests(dir));  // exl3-tool quantize / digest, after the shards
#pragma once

#include <string>

#include "absl/status/status.h"

namespace exl3 {

// Hashes every tensor of the model directory `dir` and writes its weights.digest.json
// (atomically: a temporary file, then rename).
absl::Status WriteWeightDigests(const std::string& dir);

}  // namespace exl3
