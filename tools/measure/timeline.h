// Measuring build: the consumer loops' timestamps (ffi/kernel_timeline.cuh's layout and events;
// tools/kernel_timeline.py reads them). Configure with -DJZYFA_MEASURE=timeline: CMake force-
// includes this header into every CUDA translation unit. Each unit has its own array (internal
// linkage) and registers its reader; a read sums them all (only the units whose kernels ran hold
// stamps) and zeroes them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_timeline.cuh"
#include "measure_variant.h"

namespace jzyfa {

static __device__ uint64_t g_timeline[TimelineLayout::kSlots];

class TimelineRecorder {
 public:
  __device__ explicit TimelineRecorder(int consumer) {
    if (blockIdx.x < TimelineLayout::kCtas && threadIdx.x % 128 == 0) {
      row_ = g_timeline + (static_cast<int64_t>(blockIdx.x) * TimelineLayout::kConsumers + consumer) *
                              TimelineLayout::kIterations * TimelineLayout::kEvents;
    }
  }
  __device__ void Mark(TimelineEvent event) {
    if (row_ != nullptr && iteration_ < TimelineLayout::kIterations) {
      row_[iteration_ * TimelineLayout::kEvents + event] = clock64();
    }
  }
  __device__ void Next() { ++iteration_; }
  // Tile `round` of this consumer (its loop's counter: no register of the recorder's own). The
  // row's address is formed again from the block and thread indices.
  __device__ void MarkTile(int round, TileEvent event) {
    if (row_ != nullptr && round < TimelineLayout::kTiles) {
      const int consumer = threadIdx.x / 128 - 1;  // warpgroup 0 is the producer
      g_timeline[TimelineLayout::kIterationSlots +
                 ((static_cast<int64_t>(blockIdx.x) * TimelineLayout::kConsumers + consumer) *
                      TimelineLayout::kTiles +
                  round) *
                     TimelineLayout::kTileEvents +
                 event] = clock64();
    }
  }

 private:
  uint64_t* row_ = nullptr;
  int iteration_ = 0;
};

using TimelineReader = std::string (*)(std::vector<uint64_t>*);

// One registry for the whole library (an inline function's static).
inline std::vector<TimelineReader>& TimelineReaders() {
  static std::vector<TimelineReader> readers;
  return readers;
}

// This unit's array, added into `out` and zeroed (stream-ordered after the kernels on the legacy
// default stream, so synchronize the work of interest first).
static std::string ReadThisUnitsTimeline(std::vector<uint64_t>* out) {
  std::vector<uint64_t> stamps(TimelineLayout::kSlots, 0);
  cudaError_t err = cudaMemcpyFromSymbol(stamps.data(), g_timeline, sizeof(uint64_t) * stamps.size());
  if (err == cudaSuccess) {
    const std::vector<uint64_t> zeros(TimelineLayout::kSlots, 0);
    err = cudaMemcpyToSymbol(g_timeline, zeros.data(), sizeof(uint64_t) * zeros.size());
  }
  if (err != cudaSuccess) return cudaGetErrorString(err);
  for (size_t i = 0; i < stamps.size(); ++i) (*out)[i] += stamps[i];
  return "";
}

static const bool g_timeline_registered = (TimelineReaders().push_back(ReadThisUnitsTimeline), true);

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr bool kTimeline = true;
  using Timeline = TimelineRecorder;
  static constexpr int kFp8RegCopyChunks = 5;  // the recorder's pointer and counter need registers
  static std::string ReadTimeline(std::vector<uint64_t>* out) {
    out->assign(TimelineLayout::kSlots, 0);
    for (TimelineReader read : TimelineReaders()) {
      const std::string error = read(out);
      if (!error.empty()) return error;
    }
    return "";
  }
};

}  // namespace jzyfa
