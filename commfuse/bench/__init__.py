"""``commfuse bench``: every method side by side, interleaved, with where the time goes.

`workloads` builds the ops and layers, `measure` times them on the ranks (the method, its
compute alone, its communication alone, the testbed limit, one traced iteration), `report`
turns the per-rank numbers into a table, JSON, a PNG chart and a Chrome/Perfetto trace.
"""
