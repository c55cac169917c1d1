"""pagedserve.service: the front ends over one engine (pagedserve.v1 gRPC, OpenAI HTTP, the router's
vllm.grpc.engine), each a package (service/v1/, service/openai/, service/router/) over
the shared service/core/ (engine handle, serving context, stream, admission off the loop), plus the server around
them."""
