// How long the FP8 kernel's softmax of one 128-key block takes a consumer warpgroup, alone on its
// schedulers and beside tensor-core work (docs/fp8.md 10.33). The question: the kernel's timeline
// measured ~1250 cycles per block for ~310 instructions per warp (10.7, 10.8), about 4 cycles per
// instruction where Nsight Compute saw "dispatch" and "misc" stalls even on independent instructions.
// Is that the softmax's own code (its chains, its instruction mix), or the wgmma beside it (the
// warpgroup's own P V reading P and writing O in the register file; the other consumer's GEMMs)?
//
// Three sections, one CTA per SM and no memory traffic in any; cycles are read around whole loops
// (ptxas moves arithmetic across clock reads, so no part is timed on its own), and every variant runs
// twice, with its work and with S's bits as P (no arithmetic): the difference is what the work adds.
//
// 1. The softmax beside tensor work. Warpgroup 0 runs blocks as the kernel's consumer does: Q K^T
//    (e4m3 wgmma, m64n128k32 x 4, into S) waited for, the kernel's softmax (Fp8OnlineSoftmax, lean P,
//    128 keys), P stored to shared memory (so that no variant's codes are dead code), kIterations
//    times. What else runs:
//      own P V      warpgroup 0 issues its previous block's P V (m64n136k32 x 4, A = P from registers,
//                   or m64n128k32 with A from shared memory) with the Q K^T and waits for it after the
//                   softmax, as the kernel does (the difference is then the softmax less the P V it hides);
//      other GEMMs  warpgroup 1 issues Q K^T + P V groups back to back (one in flight) while warpgroup 0
//                   runs (and some after): the other consumer's tensor work all the time instead of
//                   ~half of it (e4m3 with P V's A from registers or shared memory, or bf16);
//      twin         warpgroup 1 runs the same loop (two softmaxes per scheduler).
// 2. Per instruction: 320 instructions of one kind per thread and block instead of the softmax (FFMA,
//    FMNMX, IMAD, LOP3, HMNMX2, HFMA2, a dependent FFMA chain, MUFU.EX2), alone and beside the other
//    warpgroup's GEMMs: which pipes the tensor work slows.
// 3. Consumer schedules: every warpgroup runs the loop with its own P V (2 x 128, 2 x 192, 2 x 64 and
//    3 x 64 warpgroups x keys), with the kernel's ping-pong turns (round robin for three) or without:
//    the tensor cores' busy share the kernel's loop could reach if loads, barriers, masks, promotions,
//    rescales and tile changes cost nothing.
// The operands are e4m3 values in shared memory (no NaN); the softmax's common path has no branch
// that the data pick, so they do not change its instructions.
//
//   python3 asm/gen_ptx.py --out /tmp/gen/jzyfa_ptx.h
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Iffi -I/tmp/gen \
//     -o /tmp/softmax_interference tools/softmax_interference.cu && /tmp/softmax_interference
//
// tests/test_softmax_interference.py checks on the CPU that every probe builds without spills or wgmma
// serialization and that its timed loop holds what its variant names (the wgmmas, the softmax's codes,
// max tree and shuffles, or the synthetic instructions), so that none times dead code.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "fp8_softmax.cuh"

namespace {

using jzyfa::FenceRegisters;
using jzyfa::SmemAddress;
using jzyfa::SmemDescSw128;
constexpr int kPvN = 136;  // O's 128 columns and the 8 row-sum columns, as in the kernel
constexpr int kIterations = 1024;
// The other warpgroup's groups: >= 528 tensor cycles each, so 6144 outlast the measured loop (at most
// ~2500 cycles per block seen).
constexpr int kCompanionGroups = 6144;

// A probe's shape: key blocks of kBlockN keys (64, 128 or 192), kWarpgroups warpgroups of 64 query rows.
// Shared memory (128-byte swizzled rows of 128 bytes): Q per warpgroup (64 rows), K (kBlockN key
// rows), V^T and its ones in slices of 128 keys (136 rows each; P V's k-step j reads slice j / 4), then
// each thread's P.
template <int kBlockN_, int kWarpgroups_>
struct Shape {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kQBytes = 64 * 128;
  static constexpr int kKOffset = kWarpgroups * kQBytes;
  static constexpr int kVtOffset = kKOffset + kBlockN * 128;
  static constexpr int kVtSliceBytes = kPvN * 128;
  static constexpr int kVtSlices = (kBlockN + 127) / 128;
  static constexpr int kPSlotOffset = kVtOffset + kVtSlices * kVtSliceBytes;
  static constexpr int kSmemBytes = kPSlotOffset + kThreads * (kBlockN / 32) * 16 + 1024;  // + alignment
  // Tensor cycles of one warpgroup's block: Q K^T (64 x kBlockN x 128) and P V (64 x 136 x kBlockN) at
  // 8192 FLOP per SM and clock.
  static constexpr double kTensorCycles = 2.0 * 64 * kBlockN * (128 + kPvN) / 8192;
};
using Kernel128 = Shape<128, 2>;  // the kernel's consumers at 128 keys

// The P V beside the softmax: none; the kernel's (A = P from registers, N = 136 with the sum
// columns); or A from shared memory (N = 128: the wrappers have no 136-column shared-memory form),
// the alternative design where the softmax stores P and fences it for the async proxy.
enum PvKind { kNoPv = 0, kPvRegisters = 1, kPvShared = 2 };
// What warpgroup 1 does: nothing; Q K^T + P V groups back to back (P V of kind kPvRegisters or
// kPvShared); or the measured loop itself (twin).
// kTwinTurns: the twin with the kernel's ping-pong, each warpgroup issuing its Q K^T (and P V) only in
// its turn (named barriers: the turn passes to the other once this one's wgmmas are issued).
enum Companion { kIdle = 0, kGemmsRegisters = 1, kGemmsShared = 2, kTwin = 3, kGemmsBf16 = 4, kTwinTurns = 5 };
// What the measured warpgroup does with S each block: nothing (P = S's bits), the softmax, or
// kSyntheticSteps rounds of one instruction over its 64 values (64 independent chains; each value with
// its neighbour's previous one, so that ptxas can neither fold a round into the next nor drop one):
// which pipes the tensor work slows.
// kFfmaChainWork: FFMA with each value's previous one in this round (one dependent chain of 64 per
// round: one FFMA per ~4 cycles, leaving issue slots free, as the half-rate kinds do).
enum Work {
  kNoWork = 0,
  kSoftmaxWork = 1,
  kFfmaWork,
  kFmnmxWork,
  kImadWork,
  kLop3Work,
  kHmnmx2Work,
  kHfma2Work,
  kFfmaChainWork,
  kEx2Work
};
constexpr int kSyntheticSteps = 5;  // 320 instructions per thread and block, about the softmax's count

// One synthetic instruction: x op neighbour (bits of floats; the f16x2 kinds read them as pairs).
template <int kWork>
__device__ __forceinline__ uint32_t SyntheticStep(uint32_t x, uint32_t neighbour, uint32_t k) {
  uint32_t y;
  if constexpr (kWork == kFfmaWork || kWork == kFfmaChainWork) {
    asm volatile("fma.rn.f32 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k), "r"(neighbour));
  } else if constexpr (kWork == kEx2Work) {
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=r"(y) : "r"(x));  // nothing to fold: no neighbour
  } else if constexpr (kWork == kFmnmxWork) {
    asm volatile("max.f32 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(neighbour));
  } else if constexpr (kWork == kImadWork) {
    asm volatile("mad.lo.u32 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k), "r"(neighbour));
  } else if constexpr (kWork == kLop3Work) {
    asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(y) : "r"(x), "r"(k), "r"(neighbour));
  } else if constexpr (kWork == kHmnmx2Work) {
    asm volatile("max.f16x2 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(neighbour));
  } else {
    asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k), "r"(neighbour));
  }
  return y;
}

// Q K^T of one block into s: four k32 steps over 128-byte swizzled rows (the kernel's issue_qk).
template <int kBlockN>
__device__ __forceinline__ void IssueQk(float (&s)[kBlockN / 2], uint32_t q, uint32_t k) {
  jzyfa::ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc_q = SmemDescSw128(q + 32 * kk, 16);
    const uint64_t desc_k = SmemDescSw128(k + 32 * kk, 16);
    if (kk == 0) {
      jzyfa::ptx::Wgmma<__nv_fp8_e4m3, kBlockN>::ss_zero(s, desc_q, desc_k);
    } else {
      jzyfa::ptx::Wgmma<__nv_fp8_e4m3, kBlockN>::ss(s, desc_q, desc_k, 1);
    }
  }
}

// O += P V: kBlockN / 32 k32 steps, B = V^T's rows (the kernel's issue_pv). kPvRegisters: A = P's
// fragments in registers, N = 136; kPvShared: A = 64 rows of 128 bytes at a (P as the softmax stored
// it), N = 128.
template <int kPv, int kBlockN>
__device__ __forceinline__ void IssuePv(float (&o)[kPvN / 2], const uint32_t (&p)[kBlockN / 32][4],
                                        uint32_t a, uint32_t vt) {
  jzyfa::ptx::wgmma_fence();
#pragma unroll
  for (int j = 0; j < kBlockN / 32; ++j) {
    const uint64_t desc_vt = SmemDescSw128(vt + (j / 4) * kPvN * 128 + 32 * (j % 4), 16);
    if constexpr (kPv == kPvRegisters) {
      jzyfa::ptx::Wgmma<__nv_fp8_e4m3, kPvN>::rs(o, p[j], desc_vt, 1);
    } else {
      float (&o128)[64] = *reinterpret_cast<float (*)[64]>(o);
      jzyfa::ptx::Wgmma<__nv_fp8_e4m3, 128>::ss(o128, SmemDescSw128(a + 32 * (j % 4), 16), desc_vt, 1);
    }
  }
}

// The measured loop of one warpgroup: returns its cycles for kIterations blocks, and in *keep a
// value that depends on every output (kept alive). P goes to a per-thread slot in shared memory
// each block (four 16-byte stores) so that no variant's codes are dead code. Without the softmax P is
// the XOR of S's bits, four values per register, and salt (fresh registers: P V reading S's own
// registers made ptxas serialize the wgmmas).
template <typename S, int kOwnPv, int kWork, bool kTurns>
__device__ long long SoftmaxLoop(uint32_t q, uint32_t k, uint32_t vt, uint4* p_slot, float row_scale,
                                 uint32_t salt, int warpgroup, uint32_t* keep) {
  constexpr int kBlockN = S::kBlockN;
  // The kernel's turns (flash_fwd_fp8_kernel.cuh), round robin: barrier 1 + w is warpgroup w's turn,
  // passed on to the next warpgroup once this one's wgmmas are issued.
  constexpr int kLast = S::kWarpgroups - 1;
  auto begin_turn = [&]() { if (kTurns) jzyfa::ptx::named_barrier_sync(1 + warpgroup, 256); };
  auto end_turn = [&]() {
    if (kTurns) jzyfa::ptx::named_barrier_arrive(1 + (warpgroup == kLast ? 0 : warpgroup + 1), 256);
  };
  if (kTurns && warpgroup == kLast) jzyfa::ptx::named_barrier_arrive(1, 256);  // warpgroup 0 goes first
  jzyfa::Fp8OnlineSoftmax</*kLeanP=*/true, kBlockN> softmax;
  softmax.SetRowScale(row_scale);
  float s[kBlockN / 2];
  float o[kPvN / 2];
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) o[i] = 0.f;
  uint32_t p_even[kBlockN / 32][4] = {}, p_odd[kBlockN / 32][4] = {};
  float alpha[2] = {1.f, 1.f};
  float alpha_sum = 0.f;

  // One block; p_prev is the previous block's P (its P V issued here when kOwnPv).
  auto block = [&](const uint32_t (&p_prev)[kBlockN / 32][4], uint32_t (&p_next)[kBlockN / 32][4],
                   bool first) {
    begin_turn();
    IssueQk<kBlockN>(s, q, k);
    jzyfa::ptx::wgmma_commit_group();
    if (kOwnPv != kNoPv && !first) {
      IssuePv<kOwnPv, kBlockN>(o, p_prev, q, vt);
      jzyfa::ptx::wgmma_commit_group();
      end_turn();
      jzyfa::ptx::wgmma_wait_group<1>();
    } else {
      end_turn();
      jzyfa::ptx::wgmma_wait_group<0>();
    }
    FenceRegisters(s);
    if constexpr (kWork == kSoftmaxWork) {
      softmax.UpdateReference(s, alpha, row_scale);
      softmax.WriteCodes(s, p_next);
      alpha_sum += alpha[0] + alpha[1];
    } else {
      if constexpr (kWork != kNoWork) {
#pragma unroll
        for (int step = 0; step < kSyntheticSteps; ++step) {
          float previous[kBlockN / 2];
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) previous[i] = s[i];
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) {
            const float neighbour =
                kWork == kFfmaChainWork ? s[(i + kBlockN / 2 - 1) % (kBlockN / 2)] : previous[(i + 1) % (kBlockN / 2)];
            s[i] = __uint_as_float(SyntheticStep<kWork>(__float_as_uint(s[i]), __float_as_uint(neighbour), salt));
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kBlockN / 32; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float* u = s + 16 * j + r;  // every value of S feeds P (none is dead code)
          p_next[j][r] = __float_as_uint(u[0]) ^ __float_as_uint(u[4]) ^ __float_as_uint(u[8]) ^
                         __float_as_uint(u[12]) ^ salt;
        }
    }
#pragma unroll
    for (int j = 0; j < kBlockN / 32; ++j) {
      p_slot[j] = make_uint4(p_next[j][0], p_next[j][1], p_next[j][2], p_next[j][3]);
    }
    // P in shared memory is read by the next block's wgmma (the async proxy).
    if (kOwnPv == kPvShared) jzyfa::ptx::fence_proxy_async_shared();
    jzyfa::ptx::wgmma_wait_group<0>();
    FenceRegisters(o);
  };

  const long long start = clock64();
  block(p_odd, p_even, true);
  for (int it = 1; it + 1 < kIterations; it += 2) {
    block(p_even, p_odd, false);
    block(p_odd, p_even, false);
  }
  const long long cycles = clock64() - start;
  if (kTurns && warpgroup == 0) begin_turn();  // the last warpgroup's last hand-over

  uint32_t all = __float_as_uint(alpha_sum);
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) all ^= __float_as_uint(o[i]);
  *keep = all;
  return cycles;
}

// The other consumer's tensor work: kCompanionGroups Q K^T + P V groups (kPv: the P V's kind; kNoPv:
// eight bf16 k16 steps of m64n128 instead, 512 tensor cycles as well), one in flight. *period: its
// cycles per group until it first saw *stop (while the measured loop ran). (A fixed count: every warp
// of the warpgroup must issue the same wgmmas, and the warps could read the flag at different times.)
template <int kPv>
__device__ uint32_t GemmLoop(uint32_t q, uint32_t k, uint32_t vt, const volatile int* stop,
                             float* period) {
  constexpr int kBlockN = 128;
  float s[kBlockN / 2];
  float o[kPvN / 2];
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) o[i] = 0.f;
  uint32_t p[kBlockN / 32][4];
#pragma unroll
  for (int j = 0; j < kBlockN / 32; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[j][r] = 0x30383038u;  // e4m3 1.0 and 0.5
  const long long start = clock64();
  long long stopped_at = 0;
  int done = 0;
  for (int g = 0; g < kCompanionGroups; ++g) {
    if constexpr (kPv == kNoPv) {
      jzyfa::ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const uint64_t desc_q = SmemDescSw128(q + 32 * (kk % 4), 16);
        const uint64_t desc_k = SmemDescSw128(k + 32 * (kk % 4), 16);
        jzyfa::ptx::Wgmma<__nv_bfloat16, kBlockN>::ss(s, desc_q, desc_k, 1);
      }
    } else {
      IssueQk<kBlockN>(s, q, k);
      IssuePv<kPv, kBlockN>(o, p, q, vt);
    }
    jzyfa::ptx::wgmma_commit_group();
    jzyfa::ptx::wgmma_wait_group<1>();
    if (stopped_at == 0) {
      if (*stop) {
        stopped_at = clock64();
      } else {
        ++done;
      }
    }
  }
  jzyfa::ptx::wgmma_wait_group<0>();
  FenceRegisters(s);
  FenceRegisters(o);
  *period = done > 0 && stopped_at > 0 ? static_cast<float>(stopped_at - start) / done : 0.f;
  uint32_t keep = 0;
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) keep ^= __float_as_uint(s[i]);
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) keep ^= __float_as_uint(o[i]);
  return keep;
}

// cycles[block][warp]: the measured warps' loops (warpgroup 0, and all in the twin variants);
// periods[block]: the other warpgroup's cycles per group meanwhile.
template <typename S, int kOwnPv, int kCompanion, int kWork>
__global__ void __launch_bounds__(S::kThreads, 1)
    Probe(uint32_t seed, float row_scale, long long* cycles, float* periods, uint32_t* sink) {
  constexpr int kBlockN = S::kBlockN;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int stop;
  uint8_t* const smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const uint32_t base = SmemAddress(smem);
  // e4m3 operands: magnitudes 2^-3 .. 2^-2 (exponent field 4), any mantissa and sign; V^T's ones.
  for (int i = threadIdx.x; i < S::kPSlotOffset; i += S::kThreads) {
    const uint32_t h = (i * 2654435761u) ^ seed;
    smem[i] = static_cast<uint8_t>(0x20 | ((h >> 13) & 0x07) | ((h >> 7) & 0x80));
    if (i >= S::kVtOffset && (i - S::kVtOffset) % S::kVtSliceBytes >= 128 * 128) smem[i] = 0x38;
  }
  if (threadIdx.x == 0) stop = 0;
  jzyfa::ptx::fence_proxy_async_shared();  // generic-proxy writes, read by wgmma
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  const uint32_t q = base + warpgroup * S::kQBytes, k = base + S::kKOffset, vt = base + S::kVtOffset;
  uint4* const p_slot = reinterpret_cast<uint4*>(smem + S::kPSlotOffset) + threadIdx.x * (kBlockN / 32);
  uint32_t keep = 0;
  if (warpgroup == 0 || kCompanion == kTwin || kCompanion == kTwinTurns) {
    const long long mine = SoftmaxLoop<S, kOwnPv, kWork, kCompanion == kTwinTurns>(q, k, vt, p_slot, row_scale,
                                                                                  seed, warpgroup, &keep);
    if (threadIdx.x % 32 == 0) cycles[blockIdx.x * 16 + threadIdx.x / 32] = mine;
    if (threadIdx.x == 0) *static_cast<volatile int*>(&stop) = 1;
  } else if (kCompanion != kIdle) {
    constexpr int kPv = kCompanion == kGemmsRegisters ? kPvRegisters : kCompanion == kGemmsShared ? kPvShared : kNoPv;
    float period;
    keep = GemmLoop<kPv>(q, k, vt, &stop, &period);
    if (threadIdx.x == 128) periods[blockIdx.x] = period;
  }
  sink[blockIdx.x * S::kThreads + threadIdx.x] = keep;
}

// Mean cycles per block of the measured warps, and the other warpgroup's cycles per group (0: none).
constexpr int kMaxWarps = 16;  // per CTA, in `cycles`
constexpr int kMaxThreads = 512;

template <typename S, int kOwnPv, int kCompanion, int kWork>
bool Run(int sms, long long* cycles, float* periods, uint32_t* sink, double* per_block, double* period) {
  auto kernel = Probe<S, kOwnPv, kCompanion, kWork>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes) !=
      cudaSuccess) {
    return false;
  }
  const float row_scale = 0.1275f;  // softmax_scale * log2(e) at head dim 128: scores ~ +-1 (log2)
  cudaMemset(cycles, 0, sizeof(long long) * sms * kMaxWarps);
  cudaMemset(periods, 0, sizeof(float) * sms);
  kernel<<<sms, S::kThreads, S::kSmemBytes>>>(1u, row_scale, cycles, periods, sink);  // warm-up
  kernel<<<sms, S::kThreads, S::kSmemBytes>>>(2u, row_scale, cycles, periods, sink);
  if (cudaDeviceSynchronize() != cudaSuccess) return false;
  static long long host[1024 * kMaxWarps];
  static float host_periods[1024];
  cudaMemcpy(host, cycles, sizeof(long long) * sms * kMaxWarps, cudaMemcpyDeviceToHost);
  cudaMemcpy(host_periods, periods, sizeof(float) * sms, cudaMemcpyDeviceToHost);
  const int warps = kCompanion == kTwin || kCompanion == kTwinTurns ? S::kThreads / 32 : 4;
  double total = 0, periods_total = 0;
  for (int b = 0; b < sms; ++b) {
    for (int w = 0; w < warps; ++w) total += host[b * kMaxWarps + w];
    periods_total += host_periods[b];
  }
  *per_block = total / (static_cast<double>(sms) * warps * kIterations);
  *period = periods_total / sms;
  return true;
}

// One row: the loop with the work and without (P = S's bits), their difference, and the other
// warpgroup's cycles per group in each (its tensor work: 528 cycles for e4m3 Q K^T + P V with the
// sum columns, 512 with P V's A from shared memory or for the bf16 groups).
template <int kOwnPv, int kCompanion, int kWork = kSoftmaxWork>
bool Measure(const char* label, int sms, long long* cycles, float* periods, uint32_t* sink) {
  double with = 0, without = 0, period_with = 0, period_without = 0;
  if (!Run<Kernel128, kOwnPv, kCompanion, kWork>(sms, cycles, periods, sink, &with, &period_with) ||
      !Run<Kernel128, kOwnPv, kCompanion, kNoWork>(sms, cycles, periods, sink, &without, &period_without)) {
    return false;
  }
  std::printf("%-40s %8.0f %8.0f %8.0f   %5.0f / %5.0f\n", label, with, without, with - without,
              period_with, period_without);
  return true;
}

// The synthetic instruction kinds, alone and beside the other warpgroup's e4m3 GEMMs.
template <int kWork>
bool MeasureInstruction(const char* name, int sms, long long* cycles, float* periods, uint32_t* sink) {
  char label[64];
  std::snprintf(label, sizeof(label), "320 %s alone", name);
  if (!Measure<kNoPv, kIdle, kWork>(label, sms, cycles, periods, sink)) return false;
  std::snprintf(label, sizeof(label), "320 %s + other's GEMMs", name);
  return Measure<kNoPv, kGemmsRegisters, kWork>(label, sms, cycles, periods, sink);
}

// A consumer schedule without memory traffic: every warpgroup runs the loop (Q K^T, its previous
// block's P V from registers, the softmax), with the ping-pong's turns (round robin) or without.
// Prints the cycles per block step (each warpgroup one block) and the tensor cores' busy share.
template <typename S, int kCompanion>
bool MeasureSchedule(const char* label, int sms, long long* cycles, float* periods, uint32_t* sink) {
  double with = 0, without = 0, unused = 0;
  if (!Run<S, kPvRegisters, kCompanion, kSoftmaxWork>(sms, cycles, periods, sink, &with, &unused) ||
      !Run<S, kPvRegisters, kCompanion, kNoWork>(sms, cycles, periods, sink, &without, &unused)) {
    return false;
  }
  const double tensor = S::kWarpgroups * S::kTensorCycles;
  std::printf("%-40s %8.0f %8.0f %8.0f   tensor %4.0f cycles: %3.0f%% busy (%3.0f%% without softmax)\n", label,
              with, without, with - without, tensor, 100 * tensor / with, 100 * tensor / without);
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
  long long* cycles;
  float* periods;
  uint32_t* sink;
  cudaMalloc(&cycles, sizeof(long long) * sms * kMaxWarps);
  cudaMalloc(&periods, sizeof(float) * sms);
  cudaMalloc(&sink, sizeof(uint32_t) * sms * kMaxThreads);
  std::printf("%d SMs, one CTA each, %d blocks per warpgroup; SM cycles per block\n", sms, kIterations);
  std::printf("\nThe softmax of 128 keys beside tensor work (two warpgroups):\n");
  std::printf("%-40s %8s %8s %8s   %s\n", "variant", "work", "none", "added", "other's cycles per group");
  bool ok =
      Measure<kNoPv, kIdle>("softmax alone", sms, cycles, periods, sink) &&
      Measure<kPvRegisters, kIdle>("+ own P V (A in registers)", sms, cycles, periods, sink) &&
      Measure<kPvShared, kIdle>("+ own P V (A in shared memory)", sms, cycles, periods, sink) &&
      Measure<kNoPv, kGemmsRegisters>("+ other's GEMMs (registers)", sms, cycles, periods, sink) &&
      Measure<kNoPv, kGemmsShared>("+ other's GEMMs (shared memory)", sms, cycles, periods, sink) &&
      Measure<kNoPv, kGemmsBf16>("+ other's bf16 GEMMs", sms, cycles, periods, sink) &&
      Measure<kPvRegisters, kGemmsRegisters>("+ own P V + other's (registers)", sms, cycles, periods, sink) &&
      Measure<kPvShared, kGemmsShared>("+ own P V + other's (shared memory)", sms, cycles, periods, sink) &&
      Measure<kNoPv, kTwin>("twin (two per scheduler)", sms, cycles, periods, sink) &&
      MeasureInstruction<kFfmaWork>("FFMA", sms, cycles, periods, sink) &&
      MeasureInstruction<kFmnmxWork>("FMNMX", sms, cycles, periods, sink) &&
      MeasureInstruction<kImadWork>("IMAD", sms, cycles, periods, sink) &&
      MeasureInstruction<kLop3Work>("LOP3", sms, cycles, periods, sink) &&
      MeasureInstruction<kHmnmx2Work>("HMNMX2", sms, cycles, periods, sink) &&
      MeasureInstruction<kHfma2Work>("HFMA2", sms, cycles, periods, sink) &&
      MeasureInstruction<kFfmaChainWork>("FFMA, one chain", sms, cycles, periods, sink) &&
      MeasureInstruction<kEx2Work>("MUFU.EX2", sms, cycles, periods, sink);
  if (ok) {
    std::printf("\nConsumer schedules (each warpgroup: Q K^T, its previous P V, the softmax; no memory):\n");
    std::printf("%-40s %8s %8s %8s\n", "warpgroups x keys per block", "softmax", "none", "added");
  }
  ok = ok &&
       MeasureSchedule<Shape<128, 2>, kTwinTurns>("2 x 128, ping-pong (the kernel)", sms, cycles, periods, sink) &&
       MeasureSchedule<Shape<128, 2>, kTwin>("2 x 128, no turns", sms, cycles, periods, sink) &&
       MeasureSchedule<Shape<192, 2>, kTwinTurns>("2 x 192, ping-pong (the wide kernel)", sms, cycles, periods,
                                                   sink) &&
       MeasureSchedule<Shape<64, 2>, kTwinTurns>("2 x 64, ping-pong", sms, cycles, periods, sink) &&
       MeasureSchedule<Shape<64, 3>, kTwinTurns>("3 x 64, round-robin turns", sms, cycles, periods, sink) &&
       MeasureSchedule<Shape<64, 3>, kTwin>("3 x 64, no turns", sms, cycles, periods, sink);
  // (3 x 128 does not fit: 168 registers per thread at 384 threads, and it spills, as the kernel would.)
  cudaFree(cycles);
  cudaFree(periods);
  cudaFree(sink);
  if (!ok) std::printf("a kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
  return ok ? 0 : 1;
}
