"""The session server: agents written against the OpenAI chat API as rollout functions (`--use-session-server`).

- `chat`: request messages normalized, Qwen3 `<tool_call>` parsing, the `chat.completion` (and chunk) bodies;
- `recorder`: token-in, token-out recording of one session as a tree whose leaves are training samples;
- `server`: the OpenAI-compatible HTTP server (`/sessions/{id}/v1/chat/completions`, `/sessions/{id}/v1/models`);
- `agent`: the generate function that runs `--agent-function-path` against a session, per sample.
"""
