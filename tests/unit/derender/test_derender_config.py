"""Derender's config and CLI flags."""

from __future__ import annotations

import argparse

import pytest

from tito.config import ConfigError
from tito_derender.config import DerenderConfig
from tito_derender.server import add_arguments, config_from_args


def test_config_from_common_and_own_flags():
    parser = argparse.ArgumentParser()
    for flag, default in (("--address", "127.0.0.1:0"), ("--model", "tiny-qwen2"), ("--log-level", "info")):
        parser.add_argument(flag, default=default)
    parser.add_argument("--max-message-bytes", type=int, default=4 << 20)
    parser.add_argument("--grace-seconds", type=float, default=2.0)
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "/some/dir", "--model-cache-dir", "/tmp/c"]))
    assert (config.model, config.model_cache_dir, config.grace_seconds) == ("/some/dir", "/tmp/c", 2.0)


def test_validation_teaches():
    with pytest.raises(ConfigError, match="--model"):
        DerenderConfig(model="").validate()
    with pytest.raises(ConfigError, match="host:port"):
        DerenderConfig(address="nonsense").validate()
