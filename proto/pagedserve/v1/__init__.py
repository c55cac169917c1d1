"""pagedserve.v1: generated protobuf/gRPC stubs."""
