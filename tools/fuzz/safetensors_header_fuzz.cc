// libFuzzer target: the whole input is taken as a safetensors file and its header parsed and
// validated. Any crash, sanitizer report or leak is a bug; errors are the expected outcome.
// Built by scripts/checks/fuzz.sh (clang, -fsanitize=fuzzer,address) or with
// -DEXL3_WITH_FUZZ=ON when the compiler is clang (target exl3-fuzz-safetensors-header).
#include <cstddef>
#include <cstdint>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<exl3::SafetensorsHeader> h = exl3::ParseSafetensorsHeader(data, size, "fuzz-input");
  if (h.ok()) {
    // Touch what a reader would use: every tensor's byte range must lie inside the input.
    for (const auto& t : h->tensors) {
      if (t.end < t.begin || h->data_offset + t.end > size) __builtin_trap();
      if (t.size_bytes() > 0) {
        volatile uint8_t sink = data[h->data_offset + t.end - 1];
        (void)sink;
      }
    }
  }
  return 0;
}
