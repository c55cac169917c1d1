"""pagedserve.kernels: the PagedAttention entry point and its implementations (torch, Triton)."""
