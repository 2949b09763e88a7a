"""Put this folder on ``sys.path``: spawned ranks import their check modules by name (spawn hands the parent's
``sys.path`` to each child), and tests share :mod:`figure_checks`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
