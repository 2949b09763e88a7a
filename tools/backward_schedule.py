"""The causal attention backward's programs as a list schedule on the GPU's SMs: what the deterministic mode's launch
order (a head's key blocks last first, the order in which they add into dQ) costs against the default's (first first,
the longest first), and whether its waits (a key block adds into a dQ tile only after the next key block has) cost
anything beyond the order. One program per SM, one time unit per (key block, query tile); prints each order's
makespan in units and the ideal (the work over the SMs). Offline, no GPU (attention_notes.md, session 30).

    python3 tools/backward_schedule.py                      # (1, 32, 32768, 128): 256 key blocks of 128, tiles of 64
    python3 tools/backward_schedule.py --heads 16 --key-blocks 128
"""

from __future__ import annotations

import argparse
import heapq


def makespan(order: list[tuple[int, int]], key_blocks: int, tiles_per_block: int, sms: int, waits: bool) -> int:
    """When the last program of ``order`` ((head, key block) in launch order) ends; a program starts on the first
    SM free, key block n runs query tiles tiles_per_block * n onwards, and with ``waits`` each tile's step ends no
    earlier than key block n + 1's step on the same tile."""
    free = [(0, sm) for sm in range(sms)]
    heapq.heapify(free)
    ends: dict[tuple[int, int], dict[int, int]] = {}
    last = 0
    for head, block in order:
        t, sm = heapq.heappop(free)
        later = ends.get((head, block + 1), {}) if waits else {}
        ends[(head, block)] = steps = {}
        for tile in range(tiles_per_block * block, tiles_per_block * key_blocks):
            t = max(t + 1, later.get(tile, 0))
            steps[tile] = t
        last = max(last, t)
        heapq.heappush(free, (t, sm))
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--key-blocks", type=int, default=256, help="key blocks per head (sequence / 128)")
    parser.add_argument("--tiles-per-block", type=int, default=2, help="query tiles per key block (128 / 64)")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    for name in ("heads", "key_blocks", "tiles_per_block", "sms"):
        if getattr(args, name) < 1:
            raise SystemExit(f"backward_schedule: --{name.replace('_', '-')} must be >= 1")
    h, n, k, sms = args.heads, args.key_blocks, args.tiles_per_block, args.sms
    work = h * sum(k * (n - b) for b in range(n))
    orders = {
        "first first (default)": ([(i, b) for i in range(h) for b in range(n)], False),
        "last first, no waits": ([(i, b) for i in range(h) for b in reversed(range(n))], False),
        "last first, waits (deterministic)": ([(i, b) for i in range(h) for b in reversed(range(n))], True),
        "last first, heads in turn, waits": ([(i, b) for b in reversed(range(n)) for i in range(h)], True),
    }
    print(f"ideal: {work / sms:,.0f} units")
    for name, (order, waits) in orders.items():
        print(f"{name}: {makespan(order, n, k, sms, waits):,} units")


if __name__ == "__main__":
    main()
