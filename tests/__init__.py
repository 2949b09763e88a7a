"""Cross-package tests and the CS336 adapter interface (``tests/adapters.py``)."""
