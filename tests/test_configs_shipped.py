"""Every config file we ship loads and validates (the layouts it names exist)."""

import glob

import pytest

from paratrain import config
from paratrain.engine import checks


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.toml")))
def test_shipped_config_validates(path):
    checks.validate(config.load(path))


def test_default_toml_matches_the_embedded_default():
    assert config.load("configs/default.toml").to_dict() == config.load().to_dict()
