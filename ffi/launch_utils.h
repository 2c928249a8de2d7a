// Host-side helpers of the kernel launches: CUDA error text, TMA tensor maps through the
// driver entry point, and per-device facts read once.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
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

// The current device's ordinal, or why it cannot be used.
std::string CurrentDevice(int* device);

}  // namespace jzyfa
