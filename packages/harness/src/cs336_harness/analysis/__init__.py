"""Reading what a run recorded: profiler traces, memory snapshots, figures and tables."""
