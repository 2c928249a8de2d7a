// Optional timestamps of the attention kernels' consumer loops, for finding where a key block's
// time goes (tools/kernel_timeline.py). Off by default: built without -DJZYFA_TIMELINE=1 every
// call below compiles to nothing and the kernels' SASS is unchanged.
//
// With it, thread 0 of each consumer warpgroup of the first kCtas CTAs writes the SM clock
// (clock64) at fixed points of each steady-state key-block iteration (TimelineEvent) into a
// __device__ array, one row of kEvents per iteration, for its first kIterations iterations
// across tiles; and at fixed points of each tile (TileEvent: what happens outside the key-block
// loop, the per-tile cost that short sequences pay), one row of kTileEvents per tile, for its first
// kTiles tiles, after the iterations' rows. Each translation unit that includes this header has its
// own array (internal linkage) and reads it back with ReadTimeline (host code in the same .cu file).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jzyfa {

struct TimelineLayout {
  static constexpr int kCtas = 4;
  static constexpr int kConsumers = 2;
  static constexpr int kIterations = 2048;
  static constexpr int kEvents = 9;
  static constexpr int kTiles = 512;
  static constexpr int kTileEvents = 8;
  static constexpr int kIterationSlots = kCtas * kConsumers * kIterations * kEvents;
  static constexpr int kSlots = kIterationSlots + kCtas * kConsumers * kTiles * kTileEvents;
};

// Points of one iteration (block b: Q K^T of b and P V of b - 1), in program order. A kernel may
// leave a point out (its stamps stay 0; the tool merges the phases around it).
enum TimelineEvent : int {
  kIterationStart = 0,  // before waiting for block b's K
  kKeysReady = 1,       // K of block b has landed
  kTurnHeld = 2,        // this consumer's wgmma turn begins
  kIssued = 3,          // Q K^T and P V issued, turn handed over
  kScoresLanded = 4,    // Q K^T of block b complete
  kReferenceKnown = 5,  // FP8: the rows' maxima and reference exponents are known (not in 16-bit)
  kSoftmaxDone = 6,     // P of block b packed
  kOutputLanded = 7,    // P V of block b - 1 complete
  kIterationEnd = 8,    // after the rescale / bookkeeping
};

// Points of one tile (a consumer's 64 rows of it), in program order. Between kFirstSoftmax and
// kLastOutput run the tile's iterations (TimelineEvent). A kernel may leave a point out.
enum TileEvent : int {
  kTileStart = 0,      // the tile's index and Q are there (q_full passed)
  kFirstKeys = 1,      // K of block 0 has landed
  kFirstIssued = 2,    // Q K^T of block 0 issued, turn handed over
  kFirstScores = 3,    // Q K^T of block 0 complete (no P V beside it; the tile planned meanwhile)
  kFirstSoftmax = 4,   // P of block 0 packed
  kLastOutput = 5,     // the last P V complete
  kEpilogueStart = 6,  // O complete in registers (FP8: its float32 copy merged back)
  kTileEnd = 7,        // O and LSE handed to their stores (the epilogue done)
};

// The recorder's interface, recording nothing: the sliding-window kernels use it in JZYFA_TIMELINE
// builds too (their stamps' registers would spill).
struct NoTimeline {
  __device__ explicit NoTimeline(int) {}
  __device__ void Mark(TimelineEvent) {}
  __device__ void Next() {}
  __device__ void MarkTile(int, TileEvent) {}
};

#if defined(JZYFA_TIMELINE) && JZYFA_TIMELINE
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

// Copies the array to `out` and zeroes it for the next run (host code; stream-ordered after the
// kernels on the legacy default stream, so synchronize the work of interest first).
static inline std::string ReadTimeline(std::vector<uint64_t>* out) {
  out->assign(TimelineLayout::kSlots, 0);
  cudaError_t err = cudaMemcpyFromSymbol(out->data(), g_timeline, sizeof(uint64_t) * out->size());
  if (err == cudaSuccess) {
    const std::vector<uint64_t> zeros(TimelineLayout::kSlots, 0);
    err = cudaMemcpyToSymbol(g_timeline, zeros.data(), sizeof(uint64_t) * zeros.size());
  }
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}
#else
class TimelineRecorder {
 public:
  __device__ explicit TimelineRecorder(int) {}
  __device__ void Mark(TimelineEvent) {}
  __device__ void Next() {}
  __device__ void MarkTile(int, TileEvent) {}
};

static inline std::string ReadTimeline(std::vector<uint64_t>* out) {
  out->clear();
  return "jzyfa was built without -DJZYFA_TIMELINE=1 (set CUDAFLAGS=-DJZYFA_TIMELINE=1 and rebuild)";
}
#endif

}  // namespace jzyfa
