"""cs336_comms."""
