"""The service layer: the gRPC servicer, admission (every check above the backend seam), the seam
itself (`EngineBackend`) and the request-level observer. Both backends sit below it."""
