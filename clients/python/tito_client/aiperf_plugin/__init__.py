"""AIPerf's `--endpoint-type vllm_generate`: NVIDIA's serving benchmark (PyPI `aiperf`) driving
vLLM's token-in/token-out generate (`POST /inference/v1/generate`), on tito's gateway or on
`vllm serve --enable-scale-out` alike.

No AIPerf release ships that endpoint type (0.13.0 has none), but AIPerf takes endpoints from any
installed distribution that names a plugins.yaml under the `aiperf.plugins` entry-point group:
tito's pyproject names this package's plugins.yaml, so installing tito beside AIPerf (the test
extra) is all it takes. It lives in the client library because it is one: a caller of the HTTP
face tito's gateway serves, with no part in any service; it is the only module of tito that
imports aiperf, and only AIPerf imports it.
"""
