// exl3-decode-share-sweep: the decode ceiling (kernels/cuda/decode_ceiling_kernel.cuh: words in
// registers, decode + 2 mma per tile) at every FMA-pipe share of the state extraction
// (DecodeLaneRaw's kFmaShare, kernels/cuda/trellis_decode.cuh), per bit width and codebook, and at
// 2..6 resident blocks per SM. The defaults in DefaultFmaShare are read from its output on an
// H200 (bench/results/h200.md, session 10). Usage: exl3-decode-share-sweep (no arguments).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "base/command_line.h"
#include "kernels/cuda/decode_ceiling_kernel.cuh"

namespace exl3::cuda {
namespace {

struct Setup {
  uint32_t* seeds = nullptr;
  float* out = nullptr;
  int grid = 0;
  int smem = 0;  // dynamic shared memory per block: limits the resident blocks
};

bool Check(cudaError_t e) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "exl3-decode-share-sweep: %s\n", cudaGetErrorString(e));
  return false;
}

// Weights/s of DecodeCeilingKernel<K, CB, kShare>: median of 10 timed launches after 2.
template <int K, int CB, int kShare>
double Rate(const Setup& s) {
  const int iters = 2048;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int r = 0; r < 12; ++r) {
    cudaEventRecord(a);
    DecodeCeilingKernel<K, CB, kShare><<<s.grid, 256, s.smem>>>(s.seeds, s.out, iters, Pow2Table::Make());
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    if (r >= 2) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (!Check(cudaGetLastError())) return 0;
  std::sort(ms.begin(), ms.end());
  const double weights = double(s.grid) * 256 / 32 * iters * 4 * 256;
  return weights / (ms[ms.size() / 2] * 1e-3);
}

const char* Name(int cb) { return cb == kCbMcg ? "mcg" : cb == kCbMul1 ? "mul1" : "3inst"; }

template <int K, int CB, int... kShares>
void Sweep(const Setup& s, std::integer_sequence<int, kShares...>) {
  std::printf("K=%d %-5s default share %d:", K, Name(CB), DefaultFmaShare<K, CB>());
  ((std::printf(" %d:%.2f", kShares, Rate<K, CB, kShares>(s) / 1e12)), ...);
  std::printf("  (T weights/s by share)\n");
}

int Main(int argc, char** argv) {
  if (argc > 1) {
    std::printf("usage: exl3-decode-share-sweep\n%s",
                std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0
                    ? "The decode ceiling at every FMA-pipe share of the state extraction (see the header).\n"
                    : "");
    return std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ? 0 : 2;
  }
  int sms = 0;
  if (!Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0))) return 1;
  Setup s;
  s.grid = sms * 8;
  if (!Check(cudaMalloc(&s.seeds, 4096)) || !Check(cudaMalloc(&s.out, size_t(s.grid) * 256 * 4))) return 1;
  std::vector<uint32_t> h(1024);
  uint32_t x = 5;
  for (uint32_t& v : h) v = x = x * 1664525u + 1013904223u;
  if (!Check(cudaMemcpy(s.seeds, h.data(), 4096, cudaMemcpyHostToDevice))) return 1;
  auto kernel = DecodeCeilingKernel<2, kCbMcg>;
  if (!Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024))) return 1;
  for (int blocks : {2, 3, 4, 5, 6}) {
    s.smem = (220 * 1024) / blocks - 1024;
    int resident = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, 256, s.smem);
    std::printf("K=2 mcg default share, %d resident blocks of 8 warps per SM: %.2f T weights/s\n", resident,
                Rate<2, kCbMcg, DefaultFmaShare<2, kCbMcg>()>(s) / 1e12);
  }
  s.smem = 0;
  using Windows = std::integer_sequence<int, 0, 1, 2, 3, 4, 5, 6, 7>;  // K = 2, 4, 8: up to 7 movable
  using Direct = std::integer_sequence<int, 0, 1, 2, 3, 4, 5>;         // other K: up to 5 states
  Sweep<2, kCbMcg>(s, Windows{});
  Sweep<2, kCb3Inst>(s, Windows{});
  Sweep<2, kCbMul1>(s, Windows{});
  Sweep<4, kCbMcg>(s, Windows{});
  Sweep<4, kCbMul1>(s, Windows{});
  Sweep<8, kCbMcg>(s, Windows{});
  Sweep<1, kCbMcg>(s, Direct{});
  Sweep<3, kCbMcg>(s, Direct{});
  Sweep<3, kCbMul1>(s, Direct{});
  Sweep<5, kCbMcg>(s, Direct{});
  Sweep<6, kCbMcg>(s, Direct{});
  Sweep<6, kCbMul1>(s, Direct{});
  Sweep<7, kCbMcg>(s, Direct{});
  return 0;
}

}  // namespace
}  // namespace exl3::cuda

int main(int argc, char** argv) {
  if (exl3::PrintVersionIfAsked(argc, argv, "exl3-decode-share-sweep")) return 0;
  return exl3::cuda::Main(argc, argv);
}
