"""The MoE schedules on the simulator (`commfuse.sim.moe`): every schedule of both ops runs to
the end on every hardware preset, the GPU presets' ``serial_p2p`` (NCCL: a rank's P2P batches
run one after another, in post order) included. A schedule whose batches can only complete
out of order would hang the real op on NCCL; the engine reports it as a deadlock. Pure, no
processes.
"""

from __future__ import annotations

import math

import pytest

from commfuse.schedule.moe import METHODS, OPS, ExpertCounts
from commfuse.sim.hardware import PRESETS
from commfuse.sim.moe import MoEOp, routing_counts, simulate_moe


def _starved(world: int) -> ExpertCounts:
    """Two experts per rank; rank 1 routes nothing, nobody routes to rank W-1's experts nor
    to expert 0, and (W > 2) rank 0 keeps nothing for itself: empty messages, slots and
    GEMMs."""
    e = 2 * world
    rows = []
    for p in range(world):
        rows.append(tuple(0 if p == 1 or x == 0 or x >= e - 2 or (p == 0 and x < 2 < world)
                          else 1 + (p + x) % 5 for x in range(e)))
    return ExpertCounts(tuple(rows))


def _tables(world: int) -> dict[str, ExpertCounts]:
    return {"balanced": routing_counts("balanced", 48, 2 * world, 2, world),
            "zipf": routing_counts("zipf", 48, 2 * world, 2, world, seed=45),
            "starved": _starved(world)}


def _variants():
    """(method, splits) of every schedule: the collectives, commfuse with 1, 2, 4 pieces."""
    for method in METHODS:
        for splits in ((1, 2, 4) if method == "commfuse" else (1,)):
            yield method, splits


# every preset, and the testbed with both transport models at once (gloo's per-peer FIFO
# under NCCL's serial batches), the strictest ordering the engine has
HARDWARE = {**PRESETS, "cpu-testbed+serial": PRESETS["cpu-testbed"].with_(serial_p2p=True)}


def test_presets_include_serial_p2p():
    """The cases below are meant to cover NCCL's ordering: some preset must model it."""
    assert any(hw.serial_p2p for hw in HARDWARE.values())
    assert any(not hw.serial_p2p for hw in HARDWARE.values())


def test_starved_table_is_starved():
    for w in (2, 3, 4):
        c = _starved(w)
        assert c.sent(1) == 0 and c.received(w - 1) == 0 and (w == 2 or c.rows[0][0] == 0)
        assert sum(map(sum, c.tokens)) > 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_schedule_simulates_on_every_preset(world):
    """Every op, method, splits, tail, table on every preset: one `simulate_moe` per preset
    and table with every op back to back (a deadlock in any op stops the run), then each op
    alone where the run deadlocked, to name it."""
    ops = [MoEOp(op, method, 32, 16, chunks=3, splits=splits, tail=tail)
           for op in OPS for method, splits in _variants() for tail in (False, True)]
    failures = []
    for table, c in _tables(world).items():
        for name, hw in HARDWARE.items():
            try:
                sim = simulate_moe(ops, c, hw, step_s=1e-6)
            except RuntimeError:
                for o in ops:
                    try:
                        simulate_moe([o], c, hw)
                    except RuntimeError as e:
                        failures.append(f"{name} {table} W={world} {o.op} {o.method} "
                                        f"m={o.splits} tail={o.tail}: {e}")
                continue
            if not (all(math.isfinite(t) and t > 0 for t in sim.rank_s)
                    and sim.total_s >= sim.compute_s):
                failures.append(f"{name} {table} W={world}: {sim}")
    assert not failures, "\n".join(failures[:20])

