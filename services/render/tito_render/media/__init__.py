"""Media for render: load (limits) -> decode -> hash -> family adapter (HF image processor) ->
placeholder spans -> MultiModalItems per mm_payload. No grpc here."""
