"""pagedserve.kernels: the PagedAttention interface and entry point, its implementations (torch, native C on CPU,
Triton on CUDA), the KV cache, and the layer ops. Registries: backends.py."""
