"""The embedded rollout engine: an SGLang-protocol HTTP server on torch + transformers.

Run it with `python -m miles.engines.local --model-path DIR --port N`. Pieces: `model_runner` (KV-cache forward
passes), `sampling` (sampling params and sampler), `scheduler` (continuous batching), `weights` (refit, memory
release), `engine` (`LocalEngine`, no HTTP), `server` (FastAPI app), `dist_update` (broadcast refit group).
"""
