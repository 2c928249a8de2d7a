// Instruction throughput per SM per clock on the GPU, for the softmax's candidate instructions: one
// block of 1024 threads per SM, each thread running 8 independent chains of one instruction kind, the
// SM's cycles read with clock64 by thread 0 around the loop. Prints thread-instructions per clock per
// SM (128 = one warp-instruction per scheduler per clock) for each kind: PTX operations, which ptxas
// may fuse (two dependent max.f16x2 become one 3-input VHMNMX).
//
// The question it answers (docs/fp8.md 10.25): would a softmax in packed half math (S converted to
// f16x2 once, then HFMA2 / HMNMX2 on two scores per instruction) issue fewer cycles than the float32
// one: it depends on the rate of the f32 -> f16x2 conversion (F2FP.F16.F32.PACK_AB), which may share
// the slow unit with the e4m3 one (27 per clock per SM, DESIGN.md section 3).
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/pipe_rates tools/pipe_rates.cu && /tmp/pipe_rates
//
// tests/test_pipe_rates.py checks on the CPU that each kernel's loop holds the instruction it names.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kThreads = 1024;
constexpr int kChains = 8;
constexpr int kIterations = 4096;

// One step of each chain: the instruction under test, its output feeding its next step. A struct per
// instruction: kName, and Step(x, k) with the step's body.
#define RATE_OP(Struct, label, ...)                                \
  struct Struct {                                                  \
    static constexpr const char* kName = label;                    \
    __device__ static uint32_t Step(uint32_t x, uint32_t k) {      \
      __VA_ARGS__                                                  \
    }                                                              \
  };

__device__ __forceinline__ float F(uint32_t bits) { return __uint_as_float(bits); }

RATE_OP(Ffma, "FFMA (fma.rn.f32)", float y;
        asm volatile("fma.rn.f32 %0, %1, %2, %3;" : "=f"(y) : "f"(F(x)), "f"(F(k)), "f"(0.5f));
        return __float_as_uint(y);)
RATE_OP(Fmnmx, "FMNMX (max.f32)", float y;
        asm volatile("max.f32 %0, %1, %2;" : "=f"(y) : "f"(F(x)), "f"(F(k)));
        return __float_as_uint(y);)
RATE_OP(Hfma2, "HFMA2 (fma.rn.f16x2)", uint32_t y;
        asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k), "r"(0x38003800u));
        return y;)
RATE_OP(Hmnmx2, "HMNMX2 (max.f16x2)", uint32_t y;
        asm volatile("max.f16x2 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(k));
        return y;)
RATE_OP(F2fpF16, "F2FP f16x2 (cvt.rn.f16x2.f32)", uint32_t y;
        asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(F(x)), "f"(F(k)));
        return y;)
// A chain through one LOP3 per step (ALU): the next conversion needs this one's bits.
RATE_OP(F2fpE4m3, "F2FP e4m3x2 (cvt.rn.satfinite.e4m3x2.f32)", uint16_t y;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(y) : "f"(F(x)), "f"(F(k)));
        return x ^ y;)
RATE_OP(Prmt, "PRMT (prmt.b32)", uint32_t y;
        asm volatile("prmt.b32 %0, %1, %2, 0x6240;" : "=r"(y) : "r"(x), "r"(k));
        return y;)
RATE_OP(Imad, "IMAD (mad.lo.u32)", uint32_t y;
        asm volatile("mad.lo.u32 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k), "r"(0x1234u));
        return y;)
RATE_OP(Ex2, "MUFU.EX2 (ex2.approx.f32)", float y; (void)k;
        asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(F(x)));
        return __float_as_uint(y);)
#undef RATE_OP

template <typename Op>
__global__ void __launch_bounds__(kThreads, 1) Rate(uint32_t seed, uint32_t* sink, long long* cycles) {
  uint32_t chain[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) chain[c] = 0x3f800000u + 977u * (threadIdx.x * kChains + c) + seed;
  const uint32_t k = 0x3f000000u + seed;
  __syncthreads();
  const long long start = clock64();
#pragma unroll 4  // 32 steps per loop branch: the loop's own 3 instructions barely count
  for (int i = 0; i < kIterations; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) chain[c] = Op::Step(chain[c], k);
  }
  __syncthreads();
  const long long stop = clock64();
  uint32_t all = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) all ^= chain[c];
  sink[blockIdx.x * kThreads + threadIdx.x] = all;  // keeps the chains alive
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

template <typename Op>
bool Measure(int sms, uint32_t* sink, long long* cycles) {
  long long host[1024];
  Rate<Op><<<sms, kThreads>>>(1, sink, cycles);  // warm-up
  Rate<Op><<<sms, kThreads>>>(2, sink, cycles);
  if (cudaDeviceSynchronize() != cudaSuccess) return false;
  cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
  long long total = 0;
  for (int b = 0; b < sms; ++b) total += host[b];
  const double mean_cycles = static_cast<double>(total) / sms;
  const double per_clock = static_cast<double>(kThreads) * kIterations * kChains / mean_cycles;
  std::printf("%-44s %7.1f per clock per SM (%.0f cycles)\n", Op::kName, per_clock, mean_cycles);
  return true;
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (sms <= 0 || sms > 1024) {
    std::printf("no GPU\n");
    return 1;
  }
  uint32_t* sink;
  long long* cycles;
  cudaMalloc(&sink, sizeof(uint32_t) * sms * kThreads);
  cudaMalloc(&cycles, sizeof(long long) * sms);
  std::printf("%d SMs, %d threads each, %d independent chains per thread, %d steps\n", sms, kThreads,
              kChains, kIterations);
  const bool ok = Measure<Ffma>(sms, sink, cycles) && Measure<Fmnmx>(sms, sink, cycles) &&
                  Measure<Hfma2>(sms, sink, cycles) && Measure<Hmnmx2>(sms, sink, cycles) &&
                  Measure<F2fpF16>(sms, sink, cycles) && Measure<F2fpE4m3>(sms, sink, cycles) &&
                  Measure<Prmt>(sms, sink, cycles) && Measure<Imad>(sms, sink, cycles) &&
                  Measure<Ex2>(sms, sink, cycles);
  cudaFree(sink);
  cudaFree(cycles);
  if (!ok) std::printf("a kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
  return ok ? 0 : 1;
}
