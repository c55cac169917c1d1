"""pagedserve.service.core: what every front end shares: the engine handle (`engine_handle.py`), the serving context
(`context.py`: engine, serving state, metrics, model name), the serving lifecycle, one request's stream, admitting
off the event loop, typed errors -> status codes, raw protobuf decoding and grpc's standard services. It imports no
front end."""
