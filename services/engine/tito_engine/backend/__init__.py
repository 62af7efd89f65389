"""The backend interface: the seam both backends implement (`interface.EngineBackend`), the
admission every request passes above it, draining and the request-level observer. No grpc: the
protocol faces (`tito_engine.service`, `tito_engine.smg`) convert their messages and call it."""
