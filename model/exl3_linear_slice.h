// Output columns [first, first + count) of an EXL3 layer as an EXL3 layer of their own.
//
// EXL3's output transform works on 128-wide blocks of columns (y = (y' · H) ⊙ svh, H
// block-diagonal over 128 columns; kernels/exl3_linear.h), so a slice whose ends are multiples of
// 128 computes exactly those columns of the whole layer: its tiles are the whole's tiles of those
// columns, its svh and bias their entries, its suh the whole's. exllamav3 stores fused
// projections so (GLM-5.3's KDA q, k and v side by side as one `qkv_proj`).
//
//   EXL3_ASSIGN_OR_RETURN(auto whole, LoadExl3Linear(src, "....self_attn.qkv_proj", 4096, 3 * 4096));
//   EXL3_ASSIGN_OR_RETURN(auto k, SliceExl3LinearOutputs(*whole, 4096, 4096));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "model/exl3_linear_loader.h"

namespace exl3 {

// A copy (trellis tiles, scales and bias owned by the result). Refused: ends that are not
// multiples of 128, or beyond the layer's columns.
absl::StatusOr<std::unique_ptr<Exl3Linear>> SliceExl3LinearOutputs(const Exl3Linear& whole, int first, int count);

}  // namespace exl3
