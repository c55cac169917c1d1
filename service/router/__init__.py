"""pagedserve.service.router: the router-facing front end, vllm.grpc.engine.VllmEngine (smg-grpc-proto), with
prefix-cache events and the tokenizer bundle routers ask for."""
