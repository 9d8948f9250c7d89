"""The planner: every valid layout and method of a model on N devices, ranked by the step
`commfuse.sim.step` predicts. Pure: no torch.

    from commfuse.sim.plan import plan, table
    plans, rejected = plan("70b", 256, "h100-nvlink", seq=4096, inter_hw="multinode-400g")
    print(table(plans))

    ranking.py    the layouts a model accepts, each timed and ranked; tables and JSON records
    published.py  published training runs (torchtitan, NeMo) as data, to validate against
    hf_config.py  a transformers config.json read as a planner config (``--hf-config``)
    cli.py        ``commfuse plan``
"""

from __future__ import annotations

from commfuse.sim.plan.ranking import (METHODS, Plan, layouts, method_options, plan,
                                       plan_records, table, train_table)

__all__ = ["plan", "Plan", "layouts", "table", "train_table", "plan_records", "method_options",
           "METHODS"]
