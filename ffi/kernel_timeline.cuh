// The interface of the consumer loops' optional timestamps, for finding where a key block's time
// goes (tools/kernel_timeline.py): the layout of the recorded array, the events, and NoTimeline, the
// recorder that records nothing (the product's: MeasureVariant<>::Timeline). The recorder itself is
// a measuring build's (tools/measure/timeline.h, CMake -DJZYFA_MEASURE=timeline).
//
// There, thread 0 of each consumer warpgroup of the first kCtas CTAs writes the SM clock
// (clock64) at fixed points of each steady-state key-block iteration (TimelineEvent) into a
// __device__ array, one row of kEvents per iteration, for its first kIterations iterations
// across tiles; and at fixed points of each tile (TileEvent: what happens outside the key-block
// loop, the per-tile cost that short sequences pay), one row of kTileEvents per tile, for its first
// kTiles tiles, after the iterations' rows.
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

// The recorder's interface, recording nothing: the sliding-window kernels use it in timeline builds
// too (their stamps' registers would spill).
struct NoTimeline {
  __device__ explicit NoTimeline(int) {}
  __device__ void Mark(TimelineEvent) {}
  __device__ void Next() {}
  __device__ void MarkTile(int, TileEvent) {}
};

// The timestamps of the last runs, zeroed after reading; an error unless the build records them.
template <typename Variant>
std::string ReadTimelineOf(std::vector<uint64_t>* out) {
  if constexpr (Variant::kTimeline) {
    return Variant::ReadTimeline(out);
  } else {
    out->clear();
    return "jzyfa was built without the timeline (configure with -DJZYFA_MEASURE=timeline, "
           "tools/measure/timeline.h)";
  }
}

}  // namespace jzyfa
