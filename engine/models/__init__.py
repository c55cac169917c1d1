"""pagedserve.engine.models: model architectures. A module here that defines `ARCHITECTURES` is registered by
registry.py (which walks this package); layers.py holds what the architectures share."""
