"""miles: RL post-training with FSDP2 training actors and SGLang rollout engines."""
