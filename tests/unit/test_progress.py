"""Progress bars: drawn only when asked for and on a terminal; no-ops otherwise."""

from __future__ import annotations

import io

from miles.utils import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_and_when_asked():
    assert progress.progress_wanted(True, _Tty()) is True
    assert (
        progress.progress_wanted(True, io.StringIO()) is False
    )  # piped / redirected / a Ray worker's stderr
    assert progress.progress_wanted(False, _Tty()) is False  # --no-progress


def test_environment_carries_the_decision(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.progress_enabled() is False
    assert progress.progress_env(True) == {progress.ENV: "1"} and progress.progress_enabled()
    assert progress.progress_env(False) == {progress.ENV: "0"} and not progress.progress_enabled()


def test_disabled_bar_is_silent(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")
    with progress.progress_bar(5, "train 0", enabled=False) as bar:  # e.g. a rank other than 0
        bar.update(5)
    monkeypatch.setenv(progress.ENV, "0")
    assert list(progress.track(range(3), 3, "refit")) == [0, 1, 2]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_enabled_bar_draws_counts():
    stream = _Tty()
    with progress.progress_bar(4, "train 3", unit="mb", file=stream) as bar:
        for _ in range(4):
            bar.update()
        assert bar._bar.n == 4
    text = stream.getvalue()
    assert "train 3" in text and "0/4" in text and "mb/s" in text
