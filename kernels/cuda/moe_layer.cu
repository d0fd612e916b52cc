// DeviceMoeLayer (moe_layer.h): upload of a layer's experts, or registration of their host memory,
// with per-projection pointer tables.
#include "kernels/cuda/moe_layer.h"

#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {

DeviceMoeLayer::DeviceMoeLayer() : impl_(std::make_unique<Impl>()) {}
DeviceMoeLayer::~DeviceMoeLayer() = default;
int DeviceMoeLayer::hidden_size() const { return impl_->hidden; }
int DeviceMoeLayer::num_experts() const { return impl_->num_experts; }
bool DeviceMoeLayer::has_shared() const { return impl_->has_shared; }
size_t DeviceMoeLayer::device_bytes() const { return impl_->bytes; }
size_t DeviceMoeLayer::copied_bytes() const { return impl_->copied_bytes; }

namespace {

size_t Align(size_t x) { return (x + 255) & ~size_t{255}; }

size_t LinearBytes(const Exl3LinearView& v) {
  return Align(v.trellis_words() * 2) + Align(v.in_features * 2ul) + 2 * Align(v.out_features * 2ul);
}

// The kernels read tensors with loads of up to 16 bytes. A safetensors file only places tensor data
// at multiples of 8 from its header's end, so a tensor used in place from a file mapping may not be
// 16-byte aligned: those are copied into the layer's device block instead (Create's `put`).
constexpr uintptr_t kInPlaceAlign = 16;
bool Misaligned(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % kInPlaceAlign != 0; }

// Device bytes one linear needs: all of it when uploaded; in register mode its misaligned tensors.
size_t LinearDeviceBytes(const Exl3LinearView& v, bool register_host) {
  if (!register_host) return LinearBytes(v);
  size_t n = 0;
  if (Misaligned(v.trellis)) n += Align(v.trellis_words() * 2);
  if (Misaligned(v.suh)) n += Align(v.in_features * 2ul);
  if (Misaligned(v.svh)) n += Align(v.out_features * 2ul);
  if (Misaligned(v.bias)) n += Align(v.out_features * 2ul);
  return n;
}

// Every routed expert of a projection (and the shared expert's table of one) has the same shape;
// their K and codebook may differ (moe_layer.h). The table keeps the first expert's K and codebook.
absl::Status CheckShape(const Exl3LinearView& v, ProjTable& t, const char* what) {
  if (t.bits == 0) {
    t.k = v.in_features;
    t.n = v.out_features;
    t.bits = v.bits;
    t.cb = static_cast<int>(v.codebook);
    return absl::OkStatus();
  }
  if (v.in_features != t.k || v.out_features != t.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA MoE: every routed expert's ", what, " projection must have the same shape"));
  }
  return absl::OkStatus();
}

MoeProjSpec SpecOf(const Exl3LinearView& v) { return MoeProjSpec{v.bits, static_cast<int>(v.codebook)}; }

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Upload(const MoeLayerView& host) {
  return Create(host, /*register_host=*/false, nullptr);
}

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Register(const MoeLayerView& host,
                                                                         const HostRegistration* pages) {
  return Create(host, /*register_host=*/true, pages);
}

std::vector<HostRange> MoeLayerHostRanges(const MoeLayerView& host) {
  std::vector<HostRange> r;
  // Misaligned tensors are copied to the device by Register, not read in place: not registered.
  auto add = [&](const void* p, size_t bytes) {
    if (p != nullptr && !Misaligned(p)) r.push_back({p, bytes});
  };
  auto add_linear = [&](const Exl3LinearView& v) {
    add(v.trellis, v.trellis_words() * 2);
    add(v.suh, v.in_features * 2ul);
    add(v.svh, v.out_features * 2ul);
    add(v.bias, v.out_features * 2ul);
  };
  for (const ExpertMlp* e : host.experts) {
    if (!e) continue;
    add_linear(e->gate);
    add_linear(e->up);
    add_linear(e->down);
  }
  if (host.shared) {
    add_linear(host.shared->gate);
    add_linear(host.shared->up);
    add_linear(host.shared->down);
    add(host.shared_gate, host.hidden_size * 4ul);
  }
  return r;
}

absl::StatusOr<std::unique_ptr<DeviceMoeLayer>> DeviceMoeLayer::Create(const MoeLayerView& host, bool register_host,
                                                                       const HostRegistration* pages) {
  EXL3_RETURN_IF_ERROR(ValidateMoeLayer(host));
  std::unique_ptr<DeviceMoeLayer> layer(new DeviceMoeLayer());
  Impl& L = *layer->impl_;
  L.hidden = host.hidden_size;
  L.inter = host.intermediate_size;
  L.num_experts = host.num_experts();
  L.limit = host.swiglu_limit;
  L.has_shared = host.shared != nullptr;
  L.shared_inter = host.shared_intermediate_size;
  L.shared_limit = host.shared_swiglu_limit;
  if (L.num_experts > kMaxExperts) {
    return absl::UnimplementedError(absl::StrCat("CUDA MoE supports at most ", kMaxExperts, " experts"));
  }
  EXL3_ASSIGN_OR_RETURN(L.classes, ClassifyMoeExperts(host));
  // Sizes: tables (6 proj x 4 arrays x (E + 1) pointers), a mixed layer's class arrays (order
  // [E], class_first [classes + 1]), expert tensors, shared gate vector.
  const size_t table_entries = static_cast<size_t>(L.num_experts) + 1;
  const size_t table_bytes = Align(6 * 4 * table_entries * sizeof(void*));
  const size_t class_ints = L.classes.uniform() ? 0 : L.classes.order.size() + L.classes.class_first.size();
  // Each projection's per-expert spec codes (ProjTable::code), one byte per table entry.
  const size_t code_bytes = Align(6 * table_entries);
  size_t total = table_bytes + Align(class_ints * sizeof(int)) + code_bytes;
  for (const ExpertMlp* e : host.experts) {
    if (!e) continue;
    ++L.held;
    EXL3_RETURN_IF_ERROR(CheckShape(e->gate, L.gate, "gate"));
    EXL3_RETURN_IF_ERROR(CheckShape(e->up, L.up, "up"));
    EXL3_RETURN_IF_ERROR(CheckShape(e->down, L.down, "down"));
    total += LinearDeviceBytes(e->gate, register_host) + LinearDeviceBytes(e->up, register_host) +
             LinearDeviceBytes(e->down, register_host);
  }
  if (L.held == 0) return absl::UnimplementedError(
        "CUDA MoE: the layer holds no routed expert (a worker holding only the shared expert must "
        "use --backend cpu)");
  if (L.has_shared) {
    EXL3_RETURN_IF_ERROR(CheckShape(host.shared->gate, L.sgate, "shared gate"));
    EXL3_RETURN_IF_ERROR(CheckShape(host.shared->up, L.sup, "shared up"));
    EXL3_RETURN_IF_ERROR(CheckShape(host.shared->down, L.sdown, "shared down"));
    total += LinearDeviceBytes(host.shared->gate, register_host) +
             LinearDeviceBytes(host.shared->up, register_host) +
             LinearDeviceBytes(host.shared->down, register_host);
    if (host.shared_gate && (!register_host || Misaligned(host.shared_gate))) total += Align(L.hidden * 4ul);
    if (L.shared_inter == 0) L.shared_inter = host.shared->gate.out_features;
  }
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&L.block, total));
  L.bytes = total;
  char* base = static_cast<char*>(L.block);
  // Host images of the tables, copied at the end.
  std::vector<const void*> tables(6 * 4 * table_entries, nullptr);
  ProjTable* projs[6] = {&L.gate, &L.up, &L.down, &L.sgate, &L.sup, &L.sdown};
  for (int p = 0; p < 6; ++p) {
    const void** t = reinterpret_cast<const void**>(base) + p * 4 * table_entries;
    projs[p]->trellis = reinterpret_cast<const uint16_t**>(t);
    projs[p]->suh = reinterpret_cast<const uint16_t**>(t + table_entries);
    projs[p]->svh = reinterpret_cast<const uint16_t**>(t + 2 * table_entries);
    projs[p]->bias = reinterpret_cast<const uint16_t**>(t + 3 * table_entries);
  }
  size_t off = table_bytes;
  std::vector<int> class_image;  // copied with the tables at the end
  if (class_ints > 0) {
    // The routing kernel's class arrays (moe_kernels.cu RouteKernel), after the pointer tables.
    class_image = L.classes.order;
    class_image.insert(class_image.end(), L.classes.class_first.begin(), L.classes.class_first.end());
    L.route_classes.order = reinterpret_cast<const int*>(base + off);
    L.route_classes.class_first = L.route_classes.order + L.classes.order.size();
    L.route_classes.num_classes = L.classes.num_classes();
    off += Align(class_ints * sizeof(int));
  }
  // Each expert's K and codebook per projection, on the host (the reference path and the
  // launches' grouping read them): routed gate, up, down [E] each, then the shared expert's three.
  L.host_specs.assign(3 * static_cast<size_t>(L.num_experts) + 3, MoeProjSpec{});
  for (int e = 0; e < L.num_experts; ++e) {
    const ExpertMlp* x = host.experts[e];
    if (!x) continue;
    L.host_specs[e] = SpecOf(x->gate);
    L.host_specs[L.num_experts + e] = SpecOf(x->up);
    L.host_specs[2 * L.num_experts + e] = SpecOf(x->down);
  }
  if (L.has_shared) {
    L.host_specs[3 * L.num_experts] = SpecOf(host.shared->gate);
    L.host_specs[3 * L.num_experts + 1] = SpecOf(host.shared->up);
    L.host_specs[3 * L.num_experts + 2] = SpecOf(host.shared->down);
  }
  for (int p = 0; p < 3; ++p) {
    projs[p]->host_spec = L.host_specs.data() + static_cast<size_t>(p) * L.num_experts;
    projs[3 + p]->host_spec = L.host_specs.data() + 3 * static_cast<size_t>(L.num_experts) + p;
  }
  // The same as codes on the device, after the class arrays: projection p's at p * table_entries.
  std::vector<uint8_t> code_image(6 * table_entries, 0);
  for (int p = 0; p < 6; ++p) {
    const int entries = p < 3 ? L.num_experts : (L.has_shared ? 1 : 0);
    for (int e = 0; e < entries; ++e) {
      const MoeProjSpec& s = projs[p]->host_spec[e];
      if (s.bits > 0) code_image[p * table_entries + e] = static_cast<uint8_t>(MoeSpecCode(s.bits, s.codebook));
    }
    projs[p]->code = reinterpret_cast<const uint8_t*>(base + off) + p * table_entries;
  }
  char* const code_dst = base + off;
  off += code_bytes;
  // Register mode: the kernels read the tensors in place from pinned, mapped host pages (on
  // GB10-style unified memory at memory speed, elsewhere over the interconnect).
  int use_host_ptr = 0, dev = 0;
  if (register_host) {
    if (pages == nullptr) {
      absl::StatusOr<std::unique_ptr<HostRegistration>> own = HostRegistration::Create(MoeLayerHostRanges(host));
      if (!own.ok()) return own.status();
      L.own_pages = std::move(*own);
      pages = L.own_pages.get();
    }
    EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&use_host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, dev));
  }
  // Copies in the registered case go through pinned memory of their own (cudaMallocHost): a
  // pageable source, heap memory too, can share a page with a registered range (when the
  // registered tensors themselves live on the heap), and cudaMemcpy refuses one that straddles it.
  struct PinnedStage {
    void* p = nullptr;
    size_t cap = 0;
    ~PinnedStage() {
      if (p) cudaFreeHost(p);
    }
  } stage;
  auto staged_copy = [&](void* dst, const void* src, size_t bytes) -> absl::Status {
    if (bytes > stage.cap) {
      if (stage.p) cudaFreeHost(stage.p);
      stage.p = nullptr;
      stage.cap = 0;
      EXL3_CUDA_RETURN_IF_ERROR(cudaMallocHost(&stage.p, bytes));
      stage.cap = bytes;
    }
    std::memcpy(stage.p, src, bytes);
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, stage.p, bytes, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  };
  auto put = [&](const void* src, size_t bytes) -> absl::StatusOr<const void*> {
    if (register_host && !Misaligned(src)) {
      if (!pages->Covers(src, bytes)) {
        return absl::FailedPreconditionError("DeviceMoeLayer::Register: a tensor lies outside the given host registration");
      }
      if (use_host_ptr) return src;
      void* d = nullptr;
      EXL3_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&d, const_cast<void*>(src), 0));
      return static_cast<const void*>(d);
    }
    char* dst = base + off;
    if (register_host) {
      // The source may straddle the edge of a registered range (its page shared with an aligned
      // neighbour).
      EXL3_RETURN_IF_ERROR(staged_copy(dst, src, bytes));
      L.copied_bytes += bytes;
    } else {
      EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    }
    off += Align(bytes);
    return static_cast<const void*>(dst);
  };
  auto put_linear = [&](const Exl3LinearView& v, int proj, int index) -> absl::Status {
    const void** t = tables.data() + proj * 4 * table_entries;
    auto tr = put(v.trellis, v.trellis_words() * 2);
    if (!tr.ok()) return tr.status();
    auto su = put(v.suh, v.in_features * 2ul);
    if (!su.ok()) return su.status();
    auto sv = put(v.svh, v.out_features * 2ul);
    if (!sv.ok()) return sv.status();
    t[index] = *tr;
    t[table_entries + index] = *su;
    t[2 * table_entries + index] = *sv;
    if (v.bias) {
      auto b = put(v.bias, v.out_features * 2ul);
      if (!b.ok()) return b.status();
      t[3 * table_entries + index] = *b;
    } else if (!register_host) {
      off += Align(v.out_features * 2ul);
    }
    return absl::OkStatus();
  };
  for (int e = 0; e < L.num_experts; ++e) {
    const ExpertMlp* x = host.experts[e];
    if (!x) continue;
    EXL3_RETURN_IF_ERROR(put_linear(x->gate, 0, e));
    EXL3_RETURN_IF_ERROR(put_linear(x->up, 1, e));
    EXL3_RETURN_IF_ERROR(put_linear(x->down, 2, e));
  }
  if (L.has_shared) {
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->gate, 3, 0));
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->up, 4, 0));
    EXL3_RETURN_IF_ERROR(put_linear(host.shared->down, 5, 0));
    if (host.shared_gate) {
      auto g = put(host.shared_gate, L.hidden * 4ul);
      if (!g.ok()) return g.status();
      L.shared_gate_vec = static_cast<const float*>(*g);
    }
  }
  if (register_host) {
    EXL3_RETURN_IF_ERROR(staged_copy(base, tables.data(), tables.size() * sizeof(void*)));
    if (class_ints > 0) EXL3_RETURN_IF_ERROR(staged_copy(base + table_bytes, class_image.data(), class_ints * sizeof(int)));
    EXL3_RETURN_IF_ERROR(staged_copy(code_dst, code_image.data(), code_image.size()));
  } else {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(base, tables.data(), tables.size() * sizeof(void*), cudaMemcpyHostToDevice));
    if (class_ints > 0) {
      EXL3_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(base + table_bytes, class_image.data(), class_ints * sizeof(int), cudaMemcpyHostToDevice));
    }
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(code_dst, code_image.data(), code_image.size(), cudaMemcpyHostToDevice));
  }
  L.host_tables = std::move(tables);
  for (int p = 0; p < 6; ++p) {
    projs[p]->host_trellis = reinterpret_cast<const uint16_t* const*>(L.host_tables.data() + p * 4 * table_entries);
  }
  return layer;
}

}  // namespace exl3::cuda
