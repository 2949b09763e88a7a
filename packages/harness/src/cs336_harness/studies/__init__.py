"""What the ``cs336`` commands run: one module per study, each a frozen config and a ``run_*`` function."""
