// exl3-bench's random EXL3 linears and generator (tools/exl3_bench/random_exl3.h) as text, for
// tests/scripts/gpu/exllamav3_kernels_test.py, which holds scripts/gpu/exllamav3_kernels.py's port
// of them to this C++:
//   random_exl3_dump linear K_IN N_OUT BITS SEED   "trellis", "suh" and "svh" lines of hex words
//   random_exl3_dump rng SEED COUNT                 one line of the first COUNT Next() values (hex)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tools/exl3_bench/random_exl3.h"

namespace {

void PrintWords(const char* name, const std::vector<uint16_t>& words) {
  std::printf("%s", name);
  for (uint16_t w : words) std::printf(" %04x", w);
  std::printf("\n");
}

int Usage() {
  std::fprintf(stderr, "usage: random_exl3_dump linear K_IN N_OUT BITS SEED | rng SEED COUNT\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using exl3::benchutil::RandomLinear;
  using exl3::benchutil::Rng;
  if (argc == 6 && std::strcmp(argv[1], "linear") == 0) {
    // The codebook does not enter the bits: RandomLinear only records it in the view.
    RandomLinear l(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), exl3::Codebook::kMcg,
                   std::strtoull(argv[5], nullptr, 10));
    PrintWords("trellis", l.trellis);
    PrintWords("suh", l.suh);
    PrintWords("svh", l.svh);
    return 0;
  }
  if (argc == 4 && std::strcmp(argv[1], "rng") == 0) {
    Rng rng(std::strtoull(argv[2], nullptr, 10));
    const int count = std::atoi(argv[3]);
    std::printf("rng");
    for (int i = 0; i < count; ++i) std::printf(" %016llx", static_cast<unsigned long long>(rng.Next()));
    std::printf("\n");
    return 0;
  }
  return Usage();
}
