"""The rollout side: a plain runner (`runner.RolloutRunner`: data source -> generate -> filter -> score ->
metrics) and its seams (`base_types`): generate functions (`generate` single-turn, `multi_turn` with tools),
group filters (`filter_hub`), whole-rollout and eval functions (`default_rollout`), the rollout's async
generation client (`generate_client`; its request batching in `generate_batching`), the prompt data source with
its partial-rollout buffer (`data_source`) and rewards (`rm_hub`). Nothing here imports a training backend.

Engine control (memory release, weight versions, health) is not this package's: the driver's synchronous calls
go through `miles.utils.engine_control_http`, the trainer's refit calls through
`miles.refit.engine_endpoints`."""
