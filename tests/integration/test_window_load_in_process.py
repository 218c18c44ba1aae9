"""A training rank's refit of the engine it serves itself (`InProcessEngine`): the window load is called on the
engine directly (`served_here`, `admin_call`), not over its HTTP port, and answers as the endpoint does."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

import miles.refit.window as refit_window
from miles.engines.local.in_process import InProcessEngine
from miles.refit.window import TrainerWindow, WindowWeightUpdater
from miles.refit.window_layout import WindowLayout
from miles.tools.tiny_model import build_word_model
from miles.utils.engine_control_http import served_here

ARGS = {"num-threads": 1, "random-seed": 7, "max-running-requests": 2}


def test_window_load_of_the_engine_served_here_skips_http(tmp_path, monkeypatch):
    path = build_word_model(tmp_path / "tiny", tie_word_embeddings=True)
    eng = InProcessEngine(str(path), local_args=ARGS, admin_api_key="k").launch()
    url = eng.url
    window = None
    try:
        assert served_here(url) == eng.admin_call and served_here("http://127.0.0.1:1") is None
        direct = eng.admin_call("weight_window_layout", {}, 30)
        over_http = httpx.post(url + "/weight_window_layout", headers={"Authorization": "Bearer k"}).json()
        assert direct == over_http  # the endpoint's answer, through JSON
        layout = WindowLayout.from_json(direct["layout"])
        window = TrainerWindow(layout)

        def no_http(*args, **kwargs):
            raise AssertionError("the window load of this process's engine went over HTTP")

        monkeypatch.setattr(refit_window, "post_engine", no_http)
        updater = SimpleNamespace(windows={url: window}, headers={}, timeout_s=30.0)
        job = SimpleNamespace(weight_version="v7", flush_cache=True)
        WindowWeightUpdater._load(updater, url, job, None)  # type: ignore[arg-type]
        assert eng.engine is not None and eng.engine.model_info()["weight_version"] == "v7"
        with pytest.raises(ValueError, match="digest"):  # a refusal raises as the endpoint's 400 does
            eng.admin_call("update_weights_from_window", {"path": window.path, "layout_digest": "0" * 32}, 30)
    finally:
        if window is not None:
            window.close()
        eng.shutdown()
    assert served_here(url) is None
