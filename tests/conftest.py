"""Put this folder on ``sys.path`` so ranks started by ``torch.multiprocessing.spawn`` can import
``determinism_checks`` and ``adapters`` by name (spawn hands the parent's ``sys.path`` to each child)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
