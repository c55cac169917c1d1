"""pagedserve package."""
