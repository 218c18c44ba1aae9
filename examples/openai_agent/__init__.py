"""An agent written with the official `openai` SDK, trained through the session server (see agent.py)."""
