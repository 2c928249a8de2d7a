"""jzyfa's measuring tools, on the public API only (`jzyfa`, `jzyfa.plan` and the public modules):

  python -m jzyfa.bench            speed: TFLOP/s of jzyfa and its peers, checked against float64 (speed.py)
  python -m jzyfa.bench.accuracy   FP8's errors of O and LSE against float64, and KL on a small model
  python -m jzyfa.bench.overhead   a call's host overhead above its kernels, command buffers off and on

Each takes --help. The pieces they share: `problem` (shapes, masks, FLOPs), `peers` (the implementations
side by side), `inputs` (Gaussian and activation-like q/k/v), `float64` (the reference), `timing`
(CUPTI, CUDA events, wall clock, the SM clock) and `report` (tables, JSON, one-line errors).
docs/measuring.md explains the reports. Importing this package imports none of them.
"""
