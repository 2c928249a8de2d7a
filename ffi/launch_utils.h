// Host-side helpers of the kernel launches: CUDA error text, TMA tensor maps through the
// driver entry point, and per-device facts read once.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

namespace jzyfa {

std::string CudaError(const char* what, cudaError_t err);

// A 4-D tiled TMA map with 128-byte swizzle. dims and box innermost first; strides in bytes of
// dims 1..3. Rows past the tensor's end read as zeros.
bool EncodeTensorMap4d(CUtensorMap* map, const void* ptr, CUtensorMapDataType type,
                       const uint64_t (&dims)[4], const uint64_t (&strides)[3],
                       const uint32_t (&box)[4], std::string* error);

// What the launches need to know of a device, read once per device.
struct DeviceInfo {
  std::string error;  // empty when the device can run the kernels
  int sm_count = 0;
};

constexpr int kMaxDevices = 64;

const DeviceInfo& GetDeviceInfo(int device);

// The shared-memory opt-in of `kernel` for `bytes` of dynamic shared memory: per device and
// kernel, so set once for each (the kernel is a template argument: all of ours share one type).
template <auto kernel>
std::string AllowLargeSharedMemory(int device, int bytes) {
  static cudaError_t results[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  std::call_once(once[device], [device, bytes] {
    results[device] =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
  return results[device] == cudaSuccess ? "" : CudaError("cudaFuncSetAttribute", results[device]);
}

// The current device's ordinal, or why it cannot be used.
std::string CurrentDevice(int* device);

// The persistent grid's tile geometry in a kernel's launch arguments (any struct with these
// fields): tiles of block_m query rows per (batch, head).
template <typename Args>
void SetTileGeometry(Args& args, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                     int64_t heads_q, int64_t heads_kv, bool causal, int block_m) {
  const int64_t m_tiles = (seqlen_q + block_m - 1) / block_m;
  args.m_tiles = static_cast<int>(m_tiles);
  args.num_tiles = static_cast<int>(batch * m_tiles * heads_q);
  args.seqlen_q = static_cast<int>(seqlen_q);
  args.seqlen_k = static_cast<int>(seqlen_k);
  args.heads_q = static_cast<int>(heads_q);
  args.heads_kv = static_cast<int>(heads_kv);
  args.causal = causal ? 1 : 0;
}

// Zeroes the tile counter on `stream` and returns the persistent grid's size (one CTA per SM,
// or per tile if fewer) in *grid; or why it could not.
std::string StartTileQueue(int32_t* tile_counter, int num_tiles, int sm_count,
                           cudaStream_t stream, int* grid);

}  // namespace jzyfa
