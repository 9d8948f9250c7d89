"""scripts/qsplit_table.py --bounds on a made-up bench file: query-split against its testbed
limit, and how many cells the issue's targets are within that limit's reach."""

import json

from script_module import load

qsplit_table = load("qsplit_table")


def _result(workload, seq, limit, none, commfuse, compute):
    return {"workload": workload, "d_model": 512, "seq": seq, "pass": "forward",
            "limit_ms": limit,
            "methods": [{"method": "none", "median_ms": none, "compute_ms": compute},
                        {"method": "commfuse", "median_ms": commfuse, "compute_ms": compute}]}


def test_bounds_count_the_cells_that_the_testbed_limit_allows(tmp_path, capsys):
    # seq 2048: the limit (85) is 0.85 of row-parallel (100) and 0.85 of none: the 0.95 target
    # is within reach, and reached (qs 90); 0.80 of none is not, nor reached.
    # seq 4096: the limit (76) is 0.95 of row-parallel (80) and 0.76 of none; qs 78 reaches
    # 0.80 of none (0.78) but not 0.95 of row-parallel (0.975).
    results = [_result("attn_row", 2048, 80, 100, 100, 60),
               _result("attn_qsplit", 2048, 85, 100, 90, 60),
               _result("attn_row", 4096, 70, 100, 80, 60),
               _result("attn_qsplit", 4096, 76, 100, 78, 60)]
    path = tmp_path / "layer-2r.json"
    path.write_text(json.dumps({"meta": {}, "results": results}))
    qsplit_table.bounds([str(path)])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| 512")]
    assert lines[0].split("|")[8:10] == [" 85.0 ", " 0.850 "]  # the limit, over row
    assert lines[1].rstrip(" |").endswith("1.026")  # qs 78 over its limit 76
    assert ("<= 0.95 of row-parallel Flash-RS: query-split reached it in 1 of 2 cells; the "
            "testbed limit is within it in 2, and query-split reached it in 1 of those") in out
    assert ("<= 0.80 of none: query-split reached it in 1 of 2 cells; the testbed limit is "
            "within it in 1, and query-split reached it in 1 of those") in out
