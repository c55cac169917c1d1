"""pagedserve.service.openai: the OpenAI-compatible HTTP front end (uvicorn + Starlette on the gRPC server's loop)."""
