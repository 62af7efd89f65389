"""Derender's config and CLI flags."""

from __future__ import annotations

import argparse

import pytest

from tito_cli.main import add_common_arguments
from tito.config import ConfigError
from tito_derender.config import DerenderConfig
from tito_derender.server import add_arguments, config_from_args


def test_config_from_common_and_own_flags():
    parser = argparse.ArgumentParser()
    add_common_arguments(parser, "derender")  # what `tito serve derender` gives every service
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "/some/dir", "--model-cache-dir", "/tmp/c",
                                                 "--grace-seconds", "2"]))
    assert (config.model, config.model_cache_dir, config.grace_seconds) == ("/some/dir", "/tmp/c", 2.0)


def test_validation_teaches():
    with pytest.raises(ConfigError, match="--model"):
        DerenderConfig(model="").validate()
    with pytest.raises(ConfigError, match="host:port"):
        DerenderConfig(address="nonsense").validate()
