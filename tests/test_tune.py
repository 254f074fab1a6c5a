"""`hsdjax tune`: measured pass costs and acceptance -> a tree setting that `make_drafter` then uses."""

from __future__ import annotations

import json

import pytest

import hsdjax.core.methods as methods
import hsdjax.frontends.tune as tune_mod
from hsdjax.core.methods import make_drafter
from hsdjax.errors import HsdjaxError

QUESTION = {"question_id": 1, "category": "math",
            "turns": ["Tom has 3 apples and buys 4 more. Then he gives 2 away. How many apples does he have?"]}


@pytest.fixture()
def qfile(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n")
    return path


@pytest.fixture()
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(methods, "tuned_path", lambda fingerprint, method, kind=None: tmp_path / f"{method}.json")
    return tmp_path


@pytest.mark.slow  # the real hsd tune (80 s); test_tune_pld_* keeps tune in the default run
def test_tune_hsd_measures_each_budget_and_lookup_and_writes_the_default(qfile, tuned_dir, smollm):
    r = tune_mod.tune("smollm2-135m", "hsd", [str(qfile)], limit=1, max_new_tokens=24, widths=(2,), depths=(2,),
                      budgets=(2, 4, 9), lookups=(0, 3), node_counts=(1, 3, 5), write=True, progress=False)
    rows = {(c["depth"], c["budget"], c["lookup"]): c for c in r["candidates"]}
    # budget 9 > depth x width is not a tree of this shape
    assert set(rows) == {(2, 2, 0), (2, 2, 3), (2, 4, 0), (2, 4, 3)}
    for (depth, budget, lookup), c in rows.items():
        assert 1.0 <= c["tokens_per_pass"] <= max(depth, lookup) + 1
        assert 1.0 <= c["nodes"] <= budget + 1 + lookup  # verified tier, root included
        assert c["pass_s"] >= c["verify_s"] > 0 and c["tokens_per_s"] > 0 and c["measured_tokens_per_s"] > 0
    assert set(r["pass_cost_s"]) == {1, 3, 5}
    best = r["best"]
    written = json.loads((tuned_dir / "hsd.json").read_text())
    keys = ("depth", "width", "budget", "lookup")
    assert {k: written[k] for k in keys} == {k: best[k] for k in keys}
    drafter, _ = make_drafter("hsd", smollm)  # no explicit tree options: the tuned setting applies
    assert (drafter.depth, drafter.width, drafter.budget, drafter.lookup) == tuple(best[k] for k in keys)
    drafter, _ = make_drafter("hsd", smollm, budget=3, lookup=5)  # explicit options win
    assert (drafter.budget, drafter.lookup) == (3, 5)


def test_tune_pld_expected_rate_follows_measured_acceptance(qfile, tuned_dir):
    r = tune_mod.tune("smollm2-135m", "pld", [str(qfile)], limit=1, max_new_tokens=24, max_depth=3, widths=(1,),
                      node_counts=(1, 2, 4), progress=False)
    assert [c["depth"] for c in r["candidates"]] == [1, 2, 3]
    accept = [c["accept_at_depth"] for c in r["candidates"]]
    assert all(0.0 <= a <= 1.0 for a in accept) and accept == sorted(accept, reverse=True)  # P(>= d) falls with d
    assert accept[0] > 0  # this prompt repeats its numbers: prompt lookup finds something
    costs = r["pass_cost_s"]
    for c in r["candidates"]:
        assert c["tokens_per_pass"] == pytest.approx(1 + sum(accept[: c["depth"]]))
        assert c["nodes"] == 1 + c["depth"]
        share = c["whole_tree_share"]  # passes with a match verify the tree, the others the root alone
        assert 0.0 < share <= 1.0
        assert c["pass_s"] == pytest.approx(share * tune_mod.interpolate(costs, c["nodes"]) + (1 - share) * costs[1])
    assert not (tuned_dir / "pld.json").exists()  # nothing written without --write


def test_tune_rejects_methods_without_a_tree(qfile):
    with pytest.raises(HsdjaxError, match="tune supports"):
        tune_mod.tune("smollm2-135m", "ar", [str(qfile)])


def test_shipped_setting_applies_to_the_shipped_drafter_only(tuned_dir, smollm, tmp_path, monkeypatch):
    import jax

    from hsdjax.core.drafters.checkpoint import shipped_path

    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"smollm2-135m": {"hsd": {jax.default_backend(): {"depth": 2, "width": 2,
                                                                                      "budget": 3}}}}))
    monkeypatch.setattr(methods, "SHIPPED_TUNED", shipped)
    size = lambda d: (d.depth, d.width, d.budget)  # noqa: E731
    defaults = methods.REGISTRY["hsd"].defaults
    assert size(make_drafter("hsd", smollm)[0]) == (2, 2, 3)
    explicit = make_drafter("hsd", smollm, drafter=str(shipped_path("smollm2-135m", "hsd")))[0]
    assert size(explicit) == (defaults["depth"], defaults["width"], defaults["budget"])  # not measured for it
    assert size(make_drafter("eagle", smollm)[0]) == (defaults["depth"], defaults["width"], defaults["budget"])
    assert make_drafter("hsd", smollm, budget=4)[0].budget == 4  # explicit sizes win
    methods.write_tuned(smollm.fingerprint, "hsd", {"depth": 3, "width": 2, "budget": 4})
    assert size(make_drafter("hsd", smollm)[0]) == (3, 2, 4)  # this machine's own tuning wins


def test_shipped_lookup_lengths_apply_unless_a_graft_is_given(tuned_dir, smollm, tmp_path, monkeypatch):
    import jax

    backend = jax.default_backend()
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"smollm2-135m": {
        "hsd": {backend: {"depth": 1, "width": 3, "budget": 1, "lookup_lengths": "0,1,4"}},
        "pld": {backend: {"width": 1, "depth": 3, "lookup_lengths": "0,1,1,3"}}}}))
    monkeypatch.setattr(methods, "SHIPPED_TUNED", shipped)
    d = make_drafter("hsd", smollm)[0]
    assert d.lookup_lengths == (0, 1, 4) and d.lookup == 4 and d.tiers == (2, 3, 6)
    assert make_drafter("hsd", smollm, lookup=5)[0].lookup_lengths == (0, 5, 5)  # an explicit graft wins
    assert make_drafter("hsd", smollm, lookup_lengths="0,0,2")[0].lookup_lengths == (0, 0, 2)
    p = make_drafter("pld", smollm)[0]
    assert (p.width, p.depth, p.lengths, p.tiers) == (1, 3, (0, 1, 1, 3), (1, 2, 4))
    assert make_drafter("pld", smollm, depth=5)[0].lengths == (0, 5, 5)  # explicit sizes replace the table
    methods.write_tuned(smollm.fingerprint, "hsd", {"depth": 1, "width": 3, "budget": 1, "lookup": 3})
    assert make_drafter("hsd", smollm)[0].lookup_lengths == (0, 3, 3)  # this machine's own graft wins


def test_the_shipped_settings_name_shipped_drafters():
    data = json.loads(methods.SHIPPED_TUNED.read_text())
    for model, per_method in data.items():
        if model.startswith("_"):
            continue
        for method, per_backend in per_method.items():
            assert method in methods.TREE_METHODS, (model, method)
            if method in methods.FEATURE_METHODS:
                assert methods.has_shipped_drafter(model, method), (model, method)
            for backend, sizes in per_backend.items():
                lengths = sizes.pop("lookup_lengths", None)
                assert set(sizes) <= set(methods.TUNED_KEYS), sizes
                assert all(1 <= v <= 64 for k, v in sizes.items() if k != "lookup") and 0 <= sizes.get("lookup", 0) <= 64
                if lengths is not None:  # a valid table, read back as the drafter's
                    assert methods.parse_lookup_lengths(lengths)
                    assert (methods.shipped_tuned(model, method, (backend,))["lookup_lengths"]
                            == methods.parse_lookup_lengths(lengths))


def test_settings_are_chosen_per_instruction_set_of_the_cpu_kernels(smollm, tmp_path, monkeypatch):
    """Through the CPU kernels the entry of their instruction set applies ("cpu:avx2"), else the JAX
    backend's ("cpu": also XLA's path on a CPU); this machine's own tuning is stored per kind too."""
    import dataclasses

    import jax

    backend = jax.default_backend()
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"smollm2-135m": {"pld": {
        backend: {"width": 1, "depth": 3, "lookup_lengths": "0,1,1,3"},
        f"{backend}:avx2": {"width": 1, "depth": 2, "lookup_lengths": "0,1,1,2"}}}}))
    monkeypatch.setattr(methods, "SHIPPED_TUNED", shipped)
    monkeypatch.setattr(methods, "cache_dir", lambda name: tmp_path)
    avx2 = dataclasses.replace(smollm, backend={"path": "cpu-kernel", "isa": "avx2 (8 floats per vector)"})
    avx512 = dataclasses.replace(smollm, backend={"path": "cpu-kernel", "isa": "avx512 (16 floats per vector)"})
    xla = dataclasses.replace(smollm, backend={"path": "xla"})
    assert methods.device_kinds(avx2) == (f"{backend}:avx2", backend) and methods.device_kinds(xla) == (backend,)
    assert make_drafter("pld", avx2)[0].lengths == (0, 1, 1, 2)
    assert make_drafter("pld", avx512)[0].lengths == (0, 1, 1, 3)  # no avx512 entry: the backend's
    assert make_drafter("pld", xla)[0].lengths == (0, 1, 1, 3)
    path = methods.write_tuned(smollm.fingerprint, "pld", {"width": 1, "depth": 5}, kind=f"{backend}:avx2")
    assert path.name.endswith(f"-pld-{backend}-avx2.json") and json.loads(path.read_text())["device"] == f"{backend}:avx2"
    assert make_drafter("pld", avx2)[0].depth == 5  # this machine's own tuning of its kind wins
    assert make_drafter("pld", avx512)[0].depth == 3  # and reaches no other kind
