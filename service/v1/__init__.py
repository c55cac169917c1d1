"""pagedserve.service.v1: the pagedserve.v1 gRPC front end (GenerationService: Generate, Tokenize, ModelInfo)."""
