"""tito: token-in/token-out LLM serving as three gRPC services (render, engine, derender).

This package holds the contract's generated stubs (`tito.v1`) and the small core the three
services share: tensor codec, errors and their gRPC mapping, server bootstrap, config and
logging helpers, the tiny model builder, and the `tito` command.
"""

__version__ = "0.1.0"
