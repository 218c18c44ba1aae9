"""A small remote reward service speaking the `--rm-url` protocol, started with one command:

    python -m miles.rollout.rm_hub.server --rm-type math --port 8001
    # then train with --rm-url http://127.0.0.1:8001/reward

`POST /reward` with `{"prompt", "response", "label", "metadata"}` answers the built-in reward of `--rm-type`
(a sample's `metadata["rm_type"]` overrides it) as a JSON number or object; a bad request answers 400 with
the reason. `GET /health` answers `{}`. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.rollout.rm_hub.context import RewardContext
from miles.rollout.rm_hub.registry import get_reward_fn, reward_types
from miles.rollout.rm_hub.scoring import builtin_reward, check_reward
from miles.utils.types import Sample


def create_app(rm_type: str) -> FastAPI:
    """The FastAPI app scoring with the built-in reward type `rm_type`."""
    if rm_type.removeprefix("boxed_") == "remote_rm":
        raise ValueError("the reward service cannot itself use rm_type 'remote_rm'")
    get_reward_fn(rm_type)  # unknown types fail at start, listing the known ones
    ctx = RewardContext(rm_type=rm_type)
    app = FastAPI(title="miles reward service")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.post("/reward")
    async def reward(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("response"), str):
                raise ValueError("expected a JSON object with a string 'response'")
            metadata = body.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("'metadata' must be an object")
            sample = Sample(prompt=body.get("prompt") or "", response=body["response"], label=body.get("label"),
                            metadata=metadata)  # fmt: skip
            value = check_reward(await builtin_reward(ctx, sample), f"--rm-type={rm_type}", sample)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse(value)

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rm-type", default="math", help=f"built-in reward type, one of {reward_types()}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    a = p.parse_args(argv)
    import uvicorn

    import miles.rollout.rm_hub  # noqa: F401 - registers the built-in types

    uvicorn.run(create_app(a.rm_type), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
