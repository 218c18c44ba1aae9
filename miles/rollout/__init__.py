"""The rollout side: a plain runner (`runner.RolloutRunner`: data source -> generate -> filter -> score ->
metrics) and its seams (`base_types`): generate functions (`generate` single-turn, `multi_turn` with tools),
group filters (`filter_hub`), whole-rollout and eval functions (`default_rollout`), the engine client
(`engine_client`), the prompt data source with its partial-rollout buffer (`data_source`) and rewards
(`rm_hub`). Nothing here imports a training backend."""
