"""The embedded rollout engine: an SGLang-protocol HTTP server on torch + transformers.

Run it with `python -m miles.engines.local --model-path DIR --port N`. Pieces: `scheduler` (the pure continuous-
batching state machine), `model_runner` (batched forward passes over `kv_pool`, the preallocated KV cache),
`sampling` (sampling params and the batched sampler), `output` (answers), `engine_loop` (the thread that wires
them), `weights` (refit, memory release), `engine` (`LocalEngine`, no HTTP), `server` (FastAPI app),
`dist_update` (broadcast refit group).
"""
