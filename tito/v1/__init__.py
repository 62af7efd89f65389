"""Generated gRPC stubs for the tito.v1 contract. Do not edit: run scripts/gen_protos.py."""
