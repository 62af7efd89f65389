"""The gRPC layer of tito.v1.EngineService: the servicer and its proto <-> domain conversion.
Admission, the backend seam, drain and the request observer live in `tito_engine.backend`, which
both protocol faces (this one and `tito_engine.smg`) share."""
