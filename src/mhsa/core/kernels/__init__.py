"""Tiled attention engines: block plans, dropout masks, the flash autograd Function."""
