#include "model/exl3_linear_loader.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/fp16.h"

namespace exl3 {
namespace {

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

absl::Status BadTensor(const std::string& name, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' ", why));
}

// Reads an int32 flag scalar (shape [] or [1]) and checks its bit pattern.
absl::Status CheckFlag(const TensorView& t, uint32_t expected) {
  const std::string& name = t.info->name;
  if (t.info->dtype != DType::kI32 && t.info->dtype != DType::kU32) {
    return BadTensor(name, absl::StrCat("has dtype ", std::string(DTypeName(t.info->dtype)),
                                        ", expected I32"));
  }
  if (t.info->num_elements() != 1) {
    return BadTensor(name, absl::StrCat("has shape ", ShapeStr(t.info->shape), ", expected a scalar"));
  }
  uint32_t v;
  std::memcpy(&v, t.data, 4);
  if (v != expected) {
    return BadTensor(name, absl::StrCat("holds 0x", absl::Hex(v), ", expected 0x", absl::Hex(expected)));
  }
  return absl::OkStatus();
}

// Sign/scale vector: fp16 `<name>h` [len] or packed int16 `<name>` [len/16].
absl::Status LoadScale(const TensorSource& src, const std::string& prefix, const char* packed,
                       int len, const uint16_t** out, std::vector<uint16_t>* owned,
                       Exl3Linear* lin) {
  const std::string hname = absl::StrCat(prefix, ".", packed, "h");
  const std::string pname = absl::StrCat(prefix, ".", packed);
  if (src.Has(hname)) {
    absl::StatusOr<TensorView> t = src.Get(hname);
    if (!t.ok()) return t.status();
    if (t->info->dtype != DType::kF16) {
      return BadTensor(hname, absl::StrCat("has dtype ", std::string(DTypeName(t->info->dtype)),
                                           ", expected F16"));
    }
    if (t->info->shape != std::vector<int64_t>{len}) {
      return BadTensor(hname, absl::StrCat("has shape ", ShapeStr(t->info->shape), ", expected [",
                                           len, "]"));
    }
    *out = t->as<uint16_t>();
    lin->tensors.push_back(*t);
    return absl::OkStatus();
  }
  if (src.Has(pname)) {
    absl::StatusOr<TensorView> t = src.Get(pname);
    if (!t.ok()) return t.status();
    if (t->info->dtype != DType::kI16 && t->info->dtype != DType::kU16) {
      return BadTensor(pname, absl::StrCat("has dtype ", std::string(DTypeName(t->info->dtype)),
                                           ", expected I16"));
    }
    if (t->info->shape != std::vector<int64_t>{len / 16}) {
      return BadTensor(pname, absl::StrCat("has shape ", ShapeStr(t->info->shape), ", expected [",
                                           len / 16, "]"));
    }
    *owned = UnpackSigns(t->as<uint16_t>(), len / 16);
    *out = owned->data();
    lin->tensors.push_back(*t);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("EXL3 layer '", prefix, "' has neither '", hname,
                                          "' nor '", pname, "'"));
}

}  // namespace

int Exl3PaddedWidth(int width) { return (width + 127) / 128 * 128; }

bool HasExl3Linear(const TensorSource& src, const std::string& prefix) {
  return src.Has(prefix + ".trellis");
}

absl::StatusOr<std::unique_ptr<Exl3Linear>> LoadExl3Linear(const TensorSource& src,
                                                           const std::string& prefix,
                                                           int expect_in, int expect_out) {
  auto lin = std::make_unique<Exl3Linear>();
  lin->prefix = prefix;
  const std::string tname = prefix + ".trellis";
  if (!src.Has(tname)) {
    return absl::NotFoundError(absl::StrCat("tensor '", tname, "' is missing (no EXL3 layer at '",
                                            prefix, "')"));
  }
  absl::StatusOr<TensorView> trellis = src.Get(tname);
  if (!trellis.ok()) return trellis.status();
  const TensorInfo& ti = *trellis->info;
  if (ti.dtype != DType::kI16 && ti.dtype != DType::kU16) {
    return BadTensor(tname, absl::StrCat("has dtype ", std::string(DTypeName(ti.dtype)),
                                         ", expected I16"));
  }
  // exllamav3's half-integer rates (1.5, 2.5, 3.5 bits, mul1 only) store 16*K + 8 words per
  // tile in another bit layout, which the decoder here does not read.
  if (ti.shape.size() == 3 && ti.shape[2] % 16 == 8 && ti.shape[2] >= 24 && ti.shape[2] <= 56) {
    return BadTensor(tname, absl::StrCat("has shape ", ShapeStr(ti.shape), ": a half-integer bit "
                                         "rate (K = ", ti.shape[2] / 16, ".5, exllamav3's mul1 "
                                         "1.5/2.5/3.5-bit rates), which is not supported"));
  }
  if (ti.shape.size() != 3 || ti.shape[2] % 16 != 0 || ti.shape[2] / 16 < 1 ||
      ti.shape[2] / 16 > 8 || ti.shape[0] <= 0 || ti.shape[1] <= 0 || ti.shape[0] % 8 != 0 ||
      ti.shape[1] % 8 != 0 || ti.shape[0] > (1 << 20) || ti.shape[1] > (1 << 20)) {
    return BadTensor(tname, absl::StrCat("has shape ", ShapeStr(ti.shape),
                                         ", expected [k/16, n/16, 16*K] with K in 1..8 and k, n "
                                         "multiples of 128"));
  }
  Exl3LinearView& v = lin->view;
  v.in_features = static_cast<int>(ti.shape[0] * 16);
  v.out_features = static_cast<int>(ti.shape[1] * 16);
  v.bits = static_cast<int>(ti.shape[2] / 16);
  // exllamav3 pads a layer whose width is not a multiple of 128 with zeros up to one (e.g. an
  // MLA kv_a_proj_with_mqa of 576 or 160 outputs) and trims the output when it runs it: not an
  // EXL3 layer of the config's shape (model/exl3_padded_linear.h reads it as one).
  auto padded = [](int stored, int want) { return want >= 0 && want % 128 != 0 &&
                                                  stored == Exl3PaddedWidth(want); };
  if (padded(v.in_features, expect_in) || padded(v.out_features, expect_out)) {
    return BadTensor(tname, absl::StrCat("has shape ", ShapeStr(ti.shape), " (", v.in_features,
                                         "x", v.out_features, "): the config's ", expect_in, "x",
                                         expect_out, " layer zero-padded to multiples of 128, as "
                                         "exllamav3 stores it; this loader takes unpadded EXL3 "
                                         "layers only (LoadPaddedExl3Linear reads padded ones)"));
  }
  if ((expect_in >= 0 && v.in_features != expect_in) ||
      (expect_out >= 0 && v.out_features != expect_out)) {
    return BadTensor(tname, absl::StrCat("has shape ", ShapeStr(ti.shape), " (", v.in_features,
                                         "x", v.out_features, "), but the config needs ",
                                         expect_in, "x", expect_out));
  }
  v.trellis = trellis->as<uint16_t>();
  lin->tensors.push_back(*trellis);

  const bool mcg = src.Has(prefix + ".mcg"), mul1 = src.Has(prefix + ".mul1");
  if (mcg && mul1) {
    return absl::InvalidArgumentError(absl::StrCat("EXL3 layer '", prefix,
                                                   "' has both mcg and mul1 flags"));
  }
  v.codebook = Codebook::k3Inst;
  if (mcg || mul1) {
    const std::string fname = prefix + (mcg ? ".mcg" : ".mul1");
    absl::StatusOr<TensorView> f = src.Get(fname);
    if (!f.ok()) return f.status();
    absl::Status s = CheckFlag(*f, mcg ? kMcgMultiplier : kMul1Multiplier);
    if (!s.ok()) return s;
    v.codebook = mcg ? Codebook::kMcg : Codebook::kMul1;
    lin->tensors.push_back(*f);
  }
  absl::Status s = LoadScale(src, prefix, "su", v.in_features, &v.suh, &lin->owned_suh, lin.get());
  if (!s.ok()) return s;
  s = LoadScale(src, prefix, "sv", v.out_features, &v.svh, &lin->owned_svh, lin.get());
  if (!s.ok()) return s;

  const std::string bname = prefix + ".bias";
  if (src.Has(bname)) {
    absl::StatusOr<TensorView> b = src.Get(bname);
    if (!b.ok()) return b.status();
    if (b->info->shape != std::vector<int64_t>{v.out_features}) {
      return BadTensor(bname, absl::StrCat("has shape ", ShapeStr(b->info->shape), ", expected [",
                                           v.out_features, "]"));
    }
    if (b->info->dtype == DType::kF16) {
      v.bias = b->as<uint16_t>();
    } else {
      absl::StatusOr<std::vector<float>> f = ToFloat32(*b);
      if (!f.ok()) return BadTensor(bname, std::string(f.status().message()));
      lin->owned_bias.resize(f->size());
      for (size_t i = 0; i < f->size(); ++i) lin->owned_bias[i] = FloatToHalfBits((*f)[i]);
      v.bias = lin->owned_bias.data();
    }
    lin->tensors.push_back(*b);
  }
  for (const auto& t : lin->tensors) lin->bytes += t.size_bytes();
  s = ValidateLinear(v);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", s.message()));
  return lin;
}

}  // namespace exl3
