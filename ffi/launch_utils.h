// Host-side helpers of the kernel launches: CUDA error text, TMA tensor maps through the
// driver entry point, and per-device facts read once.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "measure_variant.h"

namespace jzyfa {

std::string CudaError(const char* what, cudaError_t err);

// A 4-D tiled TMA map, 128-byte swizzled unless `swizzle` says otherwise. dims and box innermost
// first; strides in bytes of dims 1..3. Rows past the tensor's end read as zeros.
bool EncodeTensorMap4d(CUtensorMap* map, const void* ptr, CUtensorMapDataType type,
                       const uint64_t (&dims)[4], const uint64_t (&strides)[3],
                       const uint32_t (&box)[4], std::string* error,
                       CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B);

// A row-major [batch, seq, heads, head_dim] tensor of `elem_bytes`-byte elements as a 4-D map
// (dims innermost first), boxes of `box_cols` head-dim columns x `box_rows` rows of one head. A
// packed varlen tensor [total, heads, head_dim] is a batch of one.
bool EncodeRowMap(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, int elem_bytes,
                  int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int box_cols,
                  int box_rows, std::string* error,
                  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B);

// The FP8 kernel's V^T operand, e4m3 [batch, heads_kv, head_dim, keys] (keys contiguous; a packed
// varlen V^T is a batch of one): boxes of box_keys keys x the head_dim rows of one head, 128-byte
// swizzle (64-byte for boxes of 64 keys).
bool EncodeValueOperandMap(CUtensorMap* map, const void* ptr, int64_t batch, int64_t heads_kv,
                           int64_t head_dim, int64_t keys, int box_keys, std::string* error);

// The same for bf16 / f16 tensors: boxes of 64 head-dim columns (one 128-byte swizzle row).
inline bool EncodeRowMap16(CUtensorMap* map, const void* ptr, bool bf16, int64_t batch, int64_t seq,
                           int64_t heads, int64_t head_dim, int box_rows, std::string* error) {
  const CUtensorMapDataType type =
      bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return EncodeRowMap(map, ptr, type, 2, batch, seq, heads, head_dim, 64, box_rows, error);
}

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

// Before a launch of `kernel`: the current device's facts in *info, and the kernel's opt-in to
// `dynamic_smem_bytes` of shared memory; or why it cannot launch.
template <auto kernel>
std::string PrepareLaunch(int dynamic_smem_bytes, const DeviceInfo** info) {
  int device = 0;
  std::string error = CurrentDevice(&device);
  if (!error.empty()) return error;
  *info = &GetDeviceInfo(device);
  if (!(*info)->error.empty()) return (*info)->error;
  return AllowLargeSharedMemory<kernel>(device, dynamic_smem_bytes);
}

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

// The tile order's group size (PlanTile): how many (batch, head) pairs the persistent grid works
// through together. Small groups keep concurrent CTAs on few heads (K/V shared in L2); a group
// must still hold work enough to balance the CTAs at its end: the smallest divisor of the pairs
// (equal groups) whose key work is at least kTileGroupBalance times sm_count longest tiles. Keys
// per tile from the mask (causal, or the window's left/right bounds, -1 unbounded; bottom-right
// aligned), block_m rows per tile. Measured: +2 to +4% at 16K-32K keys (docs/benchmarks.md,
// seventeenth session).
// A measuring build (tools/measure/no_tile_groups.h) makes each batch element a group: the previous
// order (heads fastest, then query tiles longest first, then batch).
constexpr int kTileGroupBalance = 2;
int TileGroupPairs(int64_t pairs, int64_t seqlen_q, int64_t seqlen_k, bool causal, int window_left,
                   int window_right, int block_m, int sm_count);

template <typename Args>
void SetTileGroups(Args& args, int sm_count, int window_left, int window_right, int block_m) {
  args.group_pairs =
      MeasureVariant<>::kTileGroups
          ? TileGroupPairs(args.num_tiles / args.m_tiles, args.seqlen_q, args.seqlen_k,
                           args.causal != 0, window_left, window_right, block_m, sm_count)
          : args.heads_q;
}

// The tile geometry and sequence fields of a varlen launch's arguments (VarlenFwdArgs's fields) from its
// parameters (FwdParams's varlen fields): tiles of block_m rows over ceil(max_seqlen_q / block_m) query
// tiles per sequence and head, for one more "sequence" than there are: the tail, tokens past
// cu_seqlens_q[num_seqs] or before cu_seqlens_q[0] (O = 0, LSE = -inf).
template <typename Args, typename Params>
void SetVarlenGeometry(Args& args, const Params& p, bool causal, int block_m) {
  args.m_tiles = static_cast<int>((p.max_seqlen_q + block_m - 1) / block_m);
  args.num_tiles = static_cast<int>((p.num_seqs + 1) * args.m_tiles * p.heads_q);
  args.num_seqs = static_cast<int>(p.num_seqs);
  args.total_q = static_cast<int>(p.total_q);
  args.heads_q = static_cast<int>(p.heads_q);
  args.heads_kv = static_cast<int>(p.heads_kv);
  args.causal = causal ? 1 : 0;
  args.cu_seqlens_q = p.cu_seqlens_q;
  args.cu_seqlens_k = p.cu_seqlens_k;
}

// The FP8 launches' descale fields (Fp8Args's, Fp8VarlenArgs's) from their parameters: one value
// for all, or one per (batch or sequence, KV head).
template <typename Args, typename Params>
void SetDescaleArgs(Args& args, const Params& p) {
  args.descale_q = p.descale_q;
  args.descale_k = p.descale_k;
  args.descale_v = p.descale_v;
  args.descale_per_head = p.descale_count > 1 ? 1 : 0;
}

// Zeroes the tile counter on `stream` and returns the persistent grid's size (one CTA per SM,
// or per tile if fewer) in *grid; or why it could not.
std::string StartTileQueue(int32_t* tile_counter, int num_tiles, int sm_count,
                           cudaStream_t stream, int* grid);

}  // namespace jzyfa
