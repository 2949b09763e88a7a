"""cs336_sharding."""
