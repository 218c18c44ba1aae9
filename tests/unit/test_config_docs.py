"""docs/configuration.md is generated from the config declarations and must be current."""

from __future__ import annotations

from miles.config import FIELDS
from miles.tools import config_docs


def test_configuration_reference_is_current(capsys):
    rc = config_docs.main(["--check"])
    assert rc == 0, capsys.readouterr().err + " (regenerate with: python -m miles.tools.config_docs)"


def test_every_flag_is_documented_and_a_stale_page_is_caught(tmp_path, capsys):
    text = config_docs.render()
    for spec in FIELDS.values():
        assert (f"`{spec.flag}`" in text) or (f"YAML key `{spec.name}`" in text), spec.name
    stale = tmp_path / "configuration.md"
    stale.write_text(text.replace("global random seed", "the seed"))
    assert config_docs.main(["--check", "--out", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert config_docs.main(["--out", str(stale)]) == 0 and stale.read_text() == text
