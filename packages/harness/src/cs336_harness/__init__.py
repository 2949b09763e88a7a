"""cs336_harness."""
