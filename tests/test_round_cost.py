"""benchmarks/round_cost.py end to end on a tiny random model: it runs and its last line is the JSON
object with the documented keys."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.conftest import TINY_LLAMA

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "round_cost.py"


def _load():
    spec = importlib.util.spec_from_file_location("round_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["round_cost"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_round_cost_tiny_end_to_end(tmp_path, capsys):
    rc = _load()
    cfg = tmp_path / "tiny.json"
    fields = {k: v for k, v in TINY_LLAMA.to_dict().items() if k not in ("dtype", "scan_layers")}
    cfg.write_text(json.dumps(fields))
    code = rc.main(["--random-weights", "--config", str(cfg), "--model", "tiny", "--json", "--rounds", "3",
                    "--repeats", "1", "--context", "20", "--buckets", "64", "--main-bucket", "64",
                    "--sizes", "2", "--long-context", "30", "--long-bucket", "64", "--long-sizes", "2",
                    "--parts", "ar,tree,long,hsd", "--layer-loop", "scan", "--dtype", "float32"])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("x ar" in line for line in out)  # the table
    result = json.loads(out[-1])
    for key in ("ar_ms", "ratios", "long_ratios", "buckets", "hsd", "eagle", "compile_s"):
        assert key in result
    assert result["ar_ms"] > 0 and result["compile_s"] > 0
    assert set(result["ratios"]) == {"2"} and all(r > 0 for r in result["ratios"].values())
    assert set(result["long_ratios"]) == {"2"}
    assert set(result["buckets"]) == {"64"} and result["buckets"]["64"]["ratios"] == result["ratios"]
    hsd = result["hsd"]
    for key in ("drafter_ms", "target_ms", "other_ms", "round_ms"):
        assert isinstance(hsd[key], float)
    assert abs(hsd["round_ms"] - hsd["drafter_ms"] - hsd["target_ms"] - hsd["other_ms"]) < 1e-9
    assert hsd["drafter_ms"] > 0 and hsd["target_ms"] > 0
    assert result["eagle"] is None  # not asked for
    # every fixed-tree round verified its N nodes and emitted at least one token
    rows = {(r["bucket"], r["what"]): r for r in result["table"]}
    assert rows[("64", "N=2")]["verified_per_round"] == 2.0
    assert rows[("64", "N=2")]["tokens_per_round"] >= 1.0


def test_fixed_tree_shapes():
    rc = _load()
    t = rc.fixed_tree(8, token=5)
    parents, depth = t.structure()
    assert (t.num_nodes, t.max_depth) == (8, 4)
    assert parents == [-1, 0, 1, 2, 3, 0, 1, 2] and depth == [0, 1, 2, 3, 4, 1, 2, 3]
    c = rc.fixed_tree(4, token=5, shape="chain")
    assert c.structure() == ([-1, 0, 1, 2], [0, 1, 2, 3]) and c.max_depth == 3
    assert rc.fixed_tree(13, token=5, depth=4).max_depth == 4
