"""Every config file we ship loads and validates (the layouts it names exist).

The folder is found from this file, not from the working directory: a cwd-relative glob finds
nothing when pytest runs from elsewhere, and an empty parametrisation is a skip, not a failure."""

from pathlib import Path

import pytest

from paratrain import config
from paratrain.engine import checks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.toml"))


def test_the_shipped_configs_are_found():
    names = {p.name for p in SHIPPED}
    assert {"default.toml", "tiny.toml"} <= names, f"{CONFIGS} holds {sorted(names)}"  # both in README


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    checks.validate(config.load(str(path)))


def test_default_toml_matches_the_embedded_default():
    assert config.load(str(CONFIGS / "default.toml")).to_dict() == config.load().to_dict()
