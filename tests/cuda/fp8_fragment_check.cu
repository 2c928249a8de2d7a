// Checks, on a Hopper GPU, the register bookkeeping the FP8 kernel's P V relies on
// (jzyfa/fp8_layout.py): a warpgroup holds P in the f32 accumulator layout of S = Q K^T, packs
// it into e4m3 A fragments without moving bytes between lanes, and multiplies by V^T whose keys
// are permuted inside each 32-key group. The product must equal P V computed on the host from
// the same e4m3 values. With V's keys in order the same fragments must give a wrong product,
// which shows the check can fail.
//
// Build: nvcc -gencode arch=compute_90a,code=sm_90a -std=c++17 -I <dir of jzyfa_ptx.h> -I ffi
// Prints one line per V layout: "<layout> max_abs_err=<e> max_abs_ref=<r>".
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "sm90_mma.cuh"

namespace {

constexpr int kRows = 64;   // one warpgroup's wgmma M
constexpr int kKeys = 128;  // one key block: four k32 steps
constexpr int kDim = 128;   // head dim: the N of P V

// Logical k of the A fragment -> key inside its 32-key group (jzyfa.fp8_layout.physical_key).
int PhysicalKey(int k) {
  const int high = k / 16, rest = k % 16, quad = rest / 4, byte = rest % 4;
  return 16 * high + 8 * (byte / 2) + 2 * quad + byte % 2;
}

__device__ uint32_t PackE4m3(float lo_a, float lo_b, float hi_a, float hi_b) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(lo_a, lo_b), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(hi_a, hi_b), __NV_SATFINITE, __NV_E4M3);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// vt: [kDim][kKeys] e4m3 bytes, K-major (keys contiguous), as the kernel's V^T tile.
__global__ void PvKernel(const float* p, const uint8_t* vt, float* out) {
  __shared__ __align__(1024) uint8_t smem_vt[kDim * kKeys];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // 128-byte swizzle: 16-byte chunk c of row n lands at chunk c ^ (n % 8).
  for (int i = tid; i < kDim * kKeys / 16; i += blockDim.x) {
    const int n = i / (kKeys / 16), chunk = i % (kKeys / 16);
    const uint4 v = reinterpret_cast<const uint4*>(vt)[i];
    reinterpret_cast<uint4*>(smem_vt)[n * (kKeys / 16) + (chunk ^ (n % 8))] = v;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  // P in the f32 accumulator layout of a 64 x kKeys wgmma result.
  float d[kKeys / 2];
  for (int c = 0; c < kKeys / 8; ++c)
    for (int e = 0; e < 4; ++e)
      d[4 * c + e] = p[(16 * warp + g + 8 * (e / 2)) * kKeys + 8 * c + 2 * t + e % 2];

  float o[kDim / 2];
  for (int i = 0; i < kDim / 2; ++i) o[i] = 0.f;
  const uint32_t base = jzyfa::SmemAddress(smem_vt);
  jzyfa::ptx::wgmma_fence();
#pragma unroll
  for (int step = 0; step < kKeys / 32; ++step) {
    const int c = 4 * step;  // the step's first 8-key accumulator chunk
    const uint32_t a[4] = {
        PackE4m3(d[4 * c + 0], d[4 * c + 1], d[4 * c + 4], d[4 * c + 5]),    // row g
        PackE4m3(d[4 * c + 2], d[4 * c + 3], d[4 * c + 6], d[4 * c + 7]),    // row g + 8
        PackE4m3(d[4 * c + 8], d[4 * c + 9], d[4 * c + 12], d[4 * c + 13]),  // row g, k + 16
        PackE4m3(d[4 * c + 10], d[4 * c + 11], d[4 * c + 14], d[4 * c + 15]),
    };
    const uint64_t desc_vt = jzyfa::SmemDescSw128(base + 32 * step, 16);
    jzyfa::ptx::WgmmaFp8<kDim>::rs(o, a, desc_vt, 1);
  }
  jzyfa::ptx::wgmma_commit_group();
  jzyfa::ptx::wgmma_wait_group<0>();
  jzyfa::FenceRegisters(o);
  for (int c = 0; c < kDim / 8; ++c)
    for (int e = 0; e < 4; ++e)
      out[(16 * warp + g + 8 * (e / 2)) * kDim + 8 * c + 2 * t + e % 2] = o[4 * c + e];
}

float E4m3(float x) { return static_cast<float>(__nv_fp8_e4m3(x)); }

uint8_t E4m3Bits(float x) { return __nv_fp8_e4m3(x).__x; }

bool Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::printf("error: %s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

}  // namespace

int main() {
  // Deterministic inputs: probabilities in [0, 1), values in [-2, 2).
  uint32_t state = 12345;
  auto uniform = [&state]() {
    state = state * 1664525u + 1013904223u;
    return (state >> 8) * (1.0f / 16777216.0f);
  };
  std::vector<float> p(kRows * kKeys), v(kKeys * kDim);
  for (float& x : p) x = uniform();
  for (float& x : v) x = 4.f * uniform() - 2.f;

  // Reference from the e4m3-rounded values, in double.
  std::vector<double> ref(kRows * kDim, 0.0);
  double max_ref = 0.0;
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < kDim; ++n) {
      double acc = 0.0;
      for (int k = 0; k < kKeys; ++k) acc += double(E4m3(p[m * kKeys + k])) * double(E4m3(v[k * kDim + n]));
      ref[m * kDim + n] = acc;
      max_ref = std::fmax(max_ref, std::fabs(acc));
    }

  float *d_p = nullptr, *d_out = nullptr;
  uint8_t* d_vt = nullptr;
  if (!Check(cudaMalloc(&d_p, p.size() * sizeof(float)), "cudaMalloc") ||
      !Check(cudaMalloc(&d_out, ref.size() * sizeof(float)), "cudaMalloc") ||
      !Check(cudaMalloc(&d_vt, kDim * kKeys), "cudaMalloc") ||
      !Check(cudaMemcpy(d_p, p.data(), p.size() * sizeof(float), cudaMemcpyHostToDevice), "copy p")) {
    return 1;
  }
  int status = 0;
  for (int permuted = 1; permuted >= 0; --permuted) {
    std::vector<uint8_t> vt(kDim * kKeys);
    for (int n = 0; n < kDim; ++n)
      for (int k = 0; k < kKeys; ++k) {
        const int key = permuted ? 32 * (k / 32) + PhysicalKey(k % 32) : k;
        vt[n * kKeys + k] = E4m3Bits(v[key * kDim + n]);
      }
    std::vector<float> out(ref.size(), NAN);
    if (!Check(cudaMemcpy(d_vt, vt.data(), vt.size(), cudaMemcpyHostToDevice), "copy vt") ||
        !Check(cudaMemset(d_out, 0xFF, out.size() * sizeof(float)), "poison out")) {
      return 1;
    }
    PvKernel<<<1, 128>>>(d_p, d_vt, d_out);
    if (!Check(cudaGetLastError(), "launch") || !Check(cudaDeviceSynchronize(), "kernel") ||
        !Check(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy out")) {
      return 1;
    }
    double max_err = 0.0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double err = std::isnan(out[i]) ? INFINITY : std::fabs(out[i] - ref[i]);
      max_err = std::fmax(max_err, err);
    }
    std::printf("%s max_abs_err=%.6e max_abs_ref=%.6e\n", permuted ? "permuted" : "in_order", max_err, max_ref);
  }
  return status;
}
