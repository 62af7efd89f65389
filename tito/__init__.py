"""tito's common runtime: what the three services share and nothing else.

The contract's generated stubs (`tito.v1`), the tensor codec, errors and their one gRPC mapping,
server bootstrap (health, reflection, limits, shutdown), typed settings, security, metrics,
tracing and logging. It imports no service, client or model builder: those sit above it
(services/, clients/python/, cli/, models/).
"""

__version__ = "0.1.0"
