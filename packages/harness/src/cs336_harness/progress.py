"""The progress bar every study shows on stderr while it runs (``--quiet`` turns it off).

One look for all of them: what is being done (the bar's description, then the unit running now as its postfix),
units done of the total, elapsed time and the estimate of what is left. It goes to stderr, so a command's
stdout stays the table alone, and it is cleared when the run ends.

    bar = progress_bar(total=len(jobs), desc="ddp", enabled=progress, unit="run")
    for job in jobs:
        bar.set_postfix_str(job.name)
        ...
        bar.update()
    bar.close()
"""

from __future__ import annotations

import threading

from tqdm import tqdm

# A run's bar is drawn by one process, so a thread lock is enough. tqdm's default lock also holds a multiprocessing
# semaphore, which a spawned rank (it leaves through os._exit) would leave behind for the parent to warn about.
_LOCK = threading.RLock()


def progress_bar(total: int | None, desc: str, enabled: bool, unit: str) -> tqdm:
    """A tqdm bar counting ``total`` units named ``unit`` (None: counts without a total); silent unless
    ``enabled``."""
    tqdm.set_lock(_LOCK)
    return tqdm(total=total, desc=desc, unit=f" {unit}", disable=not enabled, leave=False, dynamic_ncols=True)
