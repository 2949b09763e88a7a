"""cs336_basics."""
