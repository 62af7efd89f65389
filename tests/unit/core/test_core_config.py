import pytest

from tito.config import ConfigError, ServerConfig, validate_address


@pytest.mark.parametrize("address", ["127.0.0.1:0", "localhost:50051", "[::1]:8080", "unix:/tmp/x.sock",
                                     "unix:///tmp/x.sock"])
def test_good_addresses(address):
    validate_address(address)


@pytest.mark.parametrize("address", ["50051", "localhost", "host:99999", "unix:", "http://x:1"])
def test_bad_addresses_teach_the_format(address):
    with pytest.raises(ConfigError, match="host:port"if not address.startswith("unix") else "path"):
        validate_address(address)


def test_server_config_limits():
    with pytest.raises(ConfigError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=10).validate()
    with pytest.raises(ConfigError, match="log_level"):
        ServerConfig(log_level="loud").validate()
    ServerConfig().validate()
