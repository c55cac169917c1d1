"""pagedserve.service: the front ends over one engine (pagedserve.v1 gRPC, OpenAI HTTP, the router's
vllm.grpc.engine), each a thin adapter onto engine/admission.py and stream.py, plus the server around them."""
