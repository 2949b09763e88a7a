"""tools/backward_schedule.py: the list schedule behind the attention notes' cost of the deterministic launch order.
On one SM every order takes the whole work; with many SMs the longest programs first end no later than last first,
and waits only add; and the notes' figures at (1, 32, 32768, 128) come out of it."""

from __future__ import annotations

import pytest
from tool_modules import load_tool


@pytest.fixture(scope="module")
def schedule():
    return load_tool("backward_schedule")


def _orders(heads, blocks):
    first = [(h, b) for h in range(heads) for b in range(blocks)]
    last = [(h, b) for h in range(heads) for b in reversed(range(blocks))]
    return first, last


def test_one_sm_runs_the_whole_work_in_any_order(schedule):
    first, last = _orders(3, 8)
    work = 3 * sum(2 * (8 - b) for b in range(8))
    for order in (first, last):
        assert schedule.makespan(order, 8, 2, 1, waits=False) == work
        assert schedule.makespan(order, 8, 2, 1, waits=True) == work


def test_longest_first_is_no_slower_and_waits_only_add(schedule):
    first, last = _orders(4, 40)
    default = schedule.makespan(first, 40, 2, 13, waits=False)
    deterministic = schedule.makespan(last, 40, 2, 13, waits=True)
    assert default <= schedule.makespan(last, 40, 2, 13, waits=False) <= deterministic


def test_the_notes_figures(schedule):
    first, last = _orders(32, 256)
    assert schedule.makespan(first, 256, 2, 132, waits=False) == 15_958
    assert schedule.makespan(last, 256, 2, 132, waits=True) == 16_212
