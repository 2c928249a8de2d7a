// Host-side helpers of the kernel launches (see launch_utils.h).
#include "launch_utils.h"

#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "flash_fwd.h"
#include "kernel_timeline.cuh"
#include "measure_variant.h"

namespace jzyfa {
namespace {

// cuTensorMapEncodeTiled lives in the driver API; fetch it through the runtime so the
// extension links only cudart (statically) and imports on machines without a driver.
PFN_cuTensorMapEncodeTiled_v12000 GetEncodeTiled(std::string* error) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                       cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr) {
      load_error = "cannot load cuTensorMapEncodeTiled from the CUDA driver";
      if (err != cudaSuccess) load_error += ": " + CudaError("cudaGetDriverEntryPoint", err);
      return;
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  if (fn == nullptr) *error = load_error;
  return fn;
}

}  // namespace

std::string CudaError(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// A 4-D tiled map (128-byte swizzled unless asked otherwise), L2 promotion of 256 bytes; rows past
// the tensor's end read as zeros (tails need no padded copies).
bool EncodeTensorMap4d(CUtensorMap* map, const void* ptr, CUtensorMapDataType type,
                       const uint64_t (&dims)[4], const uint64_t (&strides)[3],
                       const uint32_t (&box)[4], std::string* error, CUtensorMapSwizzle swizzle) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = GetEncodeTiled(error);
  if (encode == nullptr) return false;
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  cuuint64_t dims64[4], strides64[3];
  cuuint32_t box32[4];
  for (int i = 0; i < 4; ++i) dims64[i] = dims[i], box32[i] = box[i];
  for (int i = 0; i < 3; ++i) strides64[i] = strides[i];
  CUresult res = encode(map, type, 4, const_cast<void*>(ptr), dims64, strides64, box32,
                        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    *error = "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(res);
    return false;
  }
  return true;
}

bool EncodeValueOperandMap(CUtensorMap* map, const void* ptr, int64_t batch, int64_t heads_kv,
                           int64_t head_dim, int64_t keys, int box_keys, std::string* error) {
  const uint64_t k = static_cast<uint64_t>(keys), d = static_cast<uint64_t>(head_dim);
  const uint64_t h = static_cast<uint64_t>(heads_kv), b = static_cast<uint64_t>(batch);
  const uint64_t dims[4] = {k, d, h, b};
  const uint64_t strides[3] = {k, d * k, h * d * k};
  const uint32_t box[4] = {static_cast<uint32_t>(box_keys), static_cast<uint32_t>(d), 1, 1};
  const CUtensorMapSwizzle swizzle =
      box_keys == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
  return EncodeTensorMap4d(map, ptr, CU_TENSOR_MAP_DATA_TYPE_UINT8, dims, strides, box, error,
                           swizzle);
}

bool EncodeRowMap(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, int elem_bytes,
                  int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int box_cols,
                  int box_rows, std::string* error, CUtensorMapSwizzle swizzle) {
  const uint64_t elem = static_cast<uint64_t>(elem_bytes);
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(seq),
                            static_cast<uint64_t>(heads), static_cast<uint64_t>(batch)};
  const uint64_t strides[3] = {static_cast<uint64_t>(heads * head_dim) * elem,
                               static_cast<uint64_t>(head_dim) * elem,
                               static_cast<uint64_t>(seq * heads * head_dim) * elem};
  const uint32_t box[4] = {static_cast<uint32_t>(box_cols), static_cast<uint32_t>(box_rows), 1, 1};
  return EncodeTensorMap4d(map, ptr, type, dims, strides, box, error, swizzle);
}

const DeviceInfo& GetDeviceInfo(int device) {
  static DeviceInfo infos[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  std::call_once(once[device], [device] {
    DeviceInfo& info = infos[device];
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device);
    }
    if (err != cudaSuccess) {
      info.error = CudaError("cudaDeviceGetAttribute", err);
    } else if (major != 9 || minor != 0) {
      info.error = "the jzyfa kernels need a Hopper GPU (compute capability 9.0); device " +
                   std::to_string(device) + " has " + std::to_string(major) + "." +
                   std::to_string(minor);
    }
  });
  return infos[device];
}

std::string CurrentDevice(int* device) {
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return CudaError("cudaGetDevice", err);
  if (*device < 0 || *device >= kMaxDevices) {
    return "device ordinal " + std::to_string(*device) + " is beyond the " +
           std::to_string(kMaxDevices) + " devices jzyfa tracks";
  }
  return "";
}

int TileGroupPairs(int64_t pairs, int64_t seqlen_q, int64_t seqlen_k, bool causal, int window_left,
                   int window_right, int block_m, int sm_count) {
  const int64_t m_tiles = (seqlen_q + block_m - 1) / block_m;
  if (pairs <= 1 || m_tiles < 1) return static_cast<int>(pairs);
  const int64_t right = causal && window_right < 0 ? 0 : window_right;
  const int64_t diagonal = seqlen_k - seqlen_q;
  // Past a few thousand tiles per pair one pair's work balances any grid: skip the sum.
  if (m_tiles > 4096) return 1;
  int64_t work = 0, longest = 0;  // keys over the pair's tiles, and the most one tile sees
  for (int64_t t = 0; t < m_tiles; ++t) {
    const int64_t first = t * block_m + diagonal;                                 // first row's position
    const int64_t last = std::min((t + 1) * block_m, seqlen_q) - 1 + diagonal;   // last row's
    const int64_t lo = window_left < 0 ? 0 : std::max<int64_t>(0, first - window_left);
    const int64_t hi = right < 0 ? seqlen_k : std::min(seqlen_k, last + right + 1);
    const int64_t keys = std::max<int64_t>(0, hi - lo);
    work += keys;
    longest = std::max(longest, keys);
  }
  if (work == 0) return 1;  // no keys anywhere: any order will do
  const int64_t need = kTileGroupBalance * static_cast<int64_t>(sm_count) * longest;
  // The smallest divisor of `pairs` that is large enough: every group the same size.
  int64_t group = std::clamp<int64_t>((need + work - 1) / work, 1, pairs);
  while (pairs % group != 0) ++group;
  return static_cast<int>(group);
}

std::string StartTileQueue(int32_t* tile_counter, int num_tiles, int sm_count,
                           cudaStream_t stream, int* grid) {
  cudaError_t err = cudaMemsetAsync(tile_counter, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return CudaError("zeroing the tile counter", err);
  *grid = std::min(num_tiles, sm_count);
  return "";
}

std::string ReadFwdTimeline(std::vector<uint64_t>* out) {
  return ReadTimelineOf<MeasureVariant<>>(out);
}

}  // namespace jzyfa
