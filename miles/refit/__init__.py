"""The refit: pushing the trainer's weights to the rollout engines after each train step.

The trainer calls one thing: `miles.refit.refitter.make_refitter(config, rank, world_size, is_cuda, dtype)`, then
`refitter.update(source, version, engine_urls, resume_tags)` with its model (or a LoRA model's merged view).

- `refitter`: the factory, the transfer-mode resolution and the choice of transport;
- `buckets`: the weights of a refit source under their HF names, planned into buckets and gathered (one
  all-gather per bucket), or copied row by row into shared destinations;
- `session`: what every transport shares: its setup, the engines it targets (restarted ones included) and the
  agreement through which all training ranks raise together;
- transports: `tensor_handles` (CUDA IPC / shared memory, colocated), `window` (a shared-memory weight window
  per embedded engine, colocated on CPU), `broadcast` (a side process group, disaggregated);
- `engine_endpoints`: the trainer's side of the engine's refit endpoints (session, versions, checksums);
- `window_layout`: the window layout the embedded engine (`miles.engines.local`) shares with the trainer;
- `fp8`: block FP8 of the linear weights (--rollout-weight-quantization fp8), applied to every gathered bucket
  (`buckets.stream_buckets`); the embedded engine dequantizes with it.

This package imports nothing from `miles.backends` or `miles.engines` (the engine imports `window_layout` and `fp8`). The
package itself imports nothing, so the engine loads only the layout.
"""
