"""Sharded targets (``hsdjax.runtime.sharding``): mesh strings, param specs, and sharded == single-device runs.

The multi-device checks need 8 devices (``--xla_force_host_platform_device_count=8``), but this pytest
process already initialised JAX with one CPU device, so they run in one subprocess (``_worker``) that
does them all and prints a JSON report; the tests below read it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from hsdjax.errors import HsdjaxError
from hsdjax.runtime import sharding
from hsdjax.runtime.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")
# 8 query / 8 KV heads, vocabulary 128: attention, MLP and vocabulary all split over model=8
HEADS8 = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=8, num_kv_heads=8, head_dim=8, max_context=512, scan_layers=False)
# SmolLM2's head layout (9 query / 3 KV heads): attention replicated; vocabulary 97 does not divide,
# so the embedding is split on its width; untied head, Qwen-style biases, scanned layers
HEADS3 = ModelConfig(family="qwen2", vocab_size=97, hidden_size=72, intermediate_size=96, num_layers=2,
                     num_heads=9, num_kv_heads=3, head_dim=8, max_context=512, tie_embeddings=False,
                     qkv_bias=True, scan_layers=True)


# ------------------------------------------------------------------------------------------ mesh strings
def test_parse_mesh_accepts_both_axes_and_defaults_missing_ones_to_1():
    assert sharding.parse_mesh("data=1,model=8", devices=8) == {"data": 1, "model": 8}
    assert sharding.parse_mesh(" model = 4 , data=2 ", devices=8) == {"data": 2, "model": 4}
    assert sharding.parse_mesh("model=8", devices=8) == {"data": 1, "model": 8}
    assert sharding.parse_mesh("data=1", devices=1) == {"data": 1, "model": 1}


@pytest.mark.parametrize("spec,needle", [
    ("", "empty mesh"),
    ("tensor=8", "unknown mesh axis 'tensor'"),
    ("data=1,model=x", "whole number"),
    ("model=2.5", "whole number"),
    ("model=0,data=8", "at least 1"),
    ("model=-8", "at least 1"),
    ("model", "expected AXIS=SIZE"),
    ("data=2,data=4", "given twice"),
    ("data=2,model=2", "needs 4 devices, but 8 are available"),
    ("model=16", "needs 16 devices"),
])
def test_parse_mesh_errors_are_one_line(spec, needle):
    with pytest.raises(HsdjaxError, match=needle) as info:
        sharding.parse_mesh(spec, devices=8)
    assert "\n" not in str(info.value)


def test_make_mesh_on_this_process():
    assert sharding.make_mesh(None) is None
    mesh = sharding.make_mesh("data=1,model=1")
    assert mesh.axis_names == ("data", "model") and sharding.mesh_shape(mesh) == {"data": 1, "model": 1}
    assert sharding.make_mesh(mesh) is mesh
    assert sharding.mesh_devices(None) == 1 and sharding.mesh_shape(None) == {"data": 1, "model": 1}
    with pytest.raises(HsdjaxError, match="needs 2 devices, but 1 is available"):
        sharding.make_mesh({"model": 2})
    with pytest.raises(HsdjaxError, match="unknown mesh axis"):
        sharding.make_mesh({"pipe": 1})
    with pytest.raises(HsdjaxError, match="whole number"):
        sharding.make_mesh({"model": "one"})


def test_mesh_cli_helpers():
    parser = argparse.ArgumentParser()
    sharding.add_mesh_args(parser)
    assert sharding.mesh_from_args(parser.parse_args([])) is None
    mesh = sharding.mesh_from_args(parser.parse_args(["--mesh", "model=1"]))
    assert sharding.mesh_shape(mesh) == {"data": 1, "model": 1}
    with pytest.raises(HsdjaxError, match="needs 8 devices"):
        sharding.mesh_from_args(parser.parse_args(["--mesh", "data=1,model=8"]))


def test_distributed_settings_from_environment():
    env = {"HSDJAX_COORDINATOR": "10.0.0.1:1234", "HSDJAX_NUM_PROCESSES": "4", "HSDJAX_PROCESS_ID": "3"}
    assert sharding.distributed_settings(env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                                  "process_id": 3}
    assert sharding.distributed_settings({}) == {}  # left to JAX's auto-detection (TPU pods, SLURM, ...)
    with pytest.raises(HsdjaxError, match="HSDJAX_NUM_PROCESSES must be a whole number"):
        sharding.distributed_settings({"HSDJAX_NUM_PROCESSES": "four"})
    with pytest.raises(HsdjaxError, match="must be below"):
        sharding.distributed_settings({"HSDJAX_NUM_PROCESSES": "2", "HSDJAX_PROCESS_ID": "2"})


def test_cli_bad_mesh_is_one_clear_line():
    args = ["generate", "--prompt", "hi", "--mesh", "data=1,model=x"]
    proc = subprocess.run([sys.executable, "-m", "hsdjax.frontends.cli", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2
    assert "whole number" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ param specs
def _specs(cfg: ModelConfig, model: int) -> dict:
    from hsdjax.runtime.model import init_params

    class FakeMesh:  # param_specs only reads the axis sizes
        shape = {"data": 8 // model, "model": model}

    return sharding.param_specs(cfg, jax.eval_shape(lambda: init_params(cfg)), FakeMesh())


def test_param_specs_split_heads_only_when_they_divide():
    P = jax.sharding.PartitionSpec
    s8 = _specs(HEADS8, 8)["blocks_0"]
    assert (s8["wq"], s8["wk"], s8["wv"], s8["wo"]) == (P(None, "model"),) * 3 + (P("model", None),)
    assert (s8["w_gate"], s8["w_up"], s8["w_down"]) == (P(None, "model"), P(None, "model"), P("model", None))
    assert _specs(HEADS8, 8)["embed"] == P("model", None)  # vocabulary split
    s3 = _specs(HEADS3, 8)
    layers = s3["layers"]  # stacked [L, ...]: the layer axis is never split
    assert layers["wq"] == layers["bk"] == layers["wo"] == P()  # 3 KV heads: attention replicated
    assert (layers["w_gate"], layers["w_down"]) == (P(None, None, "model"), P(None, "model", None))
    assert s3["embed"] == P(None, "model") and s3["lm_head"] == P("model", None)  # 97 rows: split the width
    assert s3["final_norm"] == P()
    assert _specs(HEADS3.replace(num_heads=12, num_kv_heads=4), 4)["layers"]["bq"] == P(None, "model")


# ------------------------------------------------------------------------------------------ 8 devices
@pytest.fixture(scope="module")
def eight_devices():
    """Run ``_worker`` on 8 forced CPU devices; its JSON report."""
    # LLVM's cheap settings halve XLA:CPU compile time (the runs are tiny); both sides of every
    # comparison are compiled with them
    flags = " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
            "--xla_llvm_disable_expensive_passes=true"
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + flags, JAX_PLATFORMS="cpu",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", "from tests.test_sharding import _worker; _worker()"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worker_sees_eight_devices(eight_devices):
    assert eight_devices["devices"] == 8


@pytest.mark.parametrize("name", ["heads8", "heads3"])
def test_sharded_logits_and_cache_equal_single_device(eight_devices, name):
    """Prefill on a 2x4 mesh: 8 KV heads split over model=4, or 3 KV heads (attention replicated)."""
    r = eight_devices["prefill"][name]
    assert r["max_abs_diff"] < 1e-5 and r["cache_max_abs_diff"] < 1e-5, r
    assert r["argmax_equal"]


def test_kv_cache_split_by_heads(eight_devices):
    """Cache rows split on data (2), the 8 KV heads on model (4); 3 KV heads stay whole."""
    assert eight_devices["prefill"]["heads8"]["cache_shard"] == [1, 2, 256, 8]  # per layer [B, K, S, D]
    assert eight_devices["prefill"]["heads3"]["cache_shard"] == [2, 1, 3, 256, 8]  # stacked [L, B, K, S, D]


@pytest.mark.parametrize("method", ["ar", "pld"])
@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_output_equals_single_device(eight_devices, method, mesh):
    r = eight_devices["greedy"]
    got = r[f"{method}@{mesh}"]
    assert got["tokens"] == r["reference"], (method, mesh)
    assert got["devices"] == 8 and got["mesh"] == sharding.parse_mesh(mesh, devices=8)
    if method == "pld":
        assert got["tokens_per_pass"] > 1  # drafts were accepted: the tree tiers ran sharded too


def test_streaming_on_a_mesh_equals_single_device(eight_devices):
    r = eight_devices["greedy"]
    assert r["stream@data=2,model=4"] == r["reference"][0]


@pytest.mark.parametrize("method", ["hsd", "eagle"])
@pytest.mark.parametrize("mesh", (None, *MESHES))
def test_feature_drafters_greedy_on_meshes_equal_single_device(eight_devices, method, mesh):
    """A random drafter checkpoint (``drafter=PATH``, bound to the sharded target, params replicated)."""
    r = eight_devices["feature"]
    got, single = r[f"{method}@{mesh}"], r[f"{method}@None"]
    assert got["tokens"] == single["tokens"] == eight_devices["greedy"]["reference"], (method, mesh)
    assert got["drafter_states"] > 0  # the drafter really drafted
    if mesh is not None:
        assert got["devices"] == 8 and got["mesh"] == sharding.parse_mesh(mesh, devices=8)
        assert got["dparams_replicated"]


@pytest.mark.parametrize("mesh", (None, *MESHES))
def test_sps_greedy_on_meshes_equals_single_device(eight_devices, mesh):
    """``sps`` with a draft LM (the target's weights perturbed: most drafts accepted, some rejected), its
    params replicated, its own KV cache beside the target's sharded one."""
    r = eight_devices["sps"]
    got = r[f"sps@{mesh}"]
    assert got["tokens"] == eight_devices["greedy"]["reference"], mesh
    assert got["accepted_drafts"] > 0 and 1.0 < got["tokens_per_pass"] < 4.0, got  # accepted and rejected drafts
    if mesh is not None:
        assert got["devices"] == 8 and got["mesh"] == sharding.parse_mesh(mesh, devices=8)
        assert got["dparams_replicated"]


def test_data_generation_on_a_mesh_equals_single_device(eight_devices):
    """``generate_data`` with the target on data=2,model=4: same tokens, same recorded states (bfloat16)."""
    r = eight_devices["datagen"]
    assert r["tokens_equal"] and r["answer_equal"] and r["tokens"] > 200, r
    assert r["states_max_abs_diff"] < 0.05 and r["top_ids_agree"] > 0.97, r


def test_data_parallel_training_matches_single_device(eight_devices):
    """Two steps on data=4,model=2 (batch 8: 2 windows per data shard) vs one device."""
    r = eight_devices["train"]
    assert r["batch_shard"] == [2, 16] and r["params_replicated"], r
    np.testing.assert_allclose(r["step_loss"]["mesh"], r["step_loss"]["single"], rtol=1e-4)
    assert r["grads_max_rel_diff"] < 1e-4, r
    assert r["history_mesh"] == pytest.approx(r["history_single"], rel=1e-3, abs=2e-4)
    assert r["params_max_rel_diff"] < 1e-4, r


def test_checkpoint_restores_onto_another_mesh(eight_devices):
    """Saved by a data=2,model=4 run; restored onto data=4,model=2 and onto one device, then continued."""
    r = eight_devices["train"]["restore"]
    assert r["restored_equal_saved"] and r["restored_on_new_mesh"], r
    assert r["resumed_logs"] == [True, True] and r["steps"] == [3, 3], r
    assert r["continued_max_rel_diff"] < 1e-4, r


def test_train_batch_must_divide_the_data_axis():
    from hsdjax.train.train import check_data_parallel

    class FakeMesh:  # check_data_parallel only reads the axis sizes
        shape = {"data": 4, "model": 2}

    check_data_parallel(8, None)
    check_data_parallel(8, FakeMesh())
    with pytest.raises(HsdjaxError, match=r"train batch 6 does not divide by the mesh's data axis \(4\)"):
        check_data_parallel(6, FakeMesh())


@pytest.mark.slow
def test_two_processes_share_one_mesh():
    """Multi-host on one machine: two processes of 4 CPU devices join through ``HSDJAX_COORDINATOR``
    (``jax.distributed``, gloo collectives); a data=2,model=4 mesh spans both, and greedy ``ar`` and
    ``pld`` equal single-device ``ar``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore", HSDJAX_COORDINATOR=f"127.0.0.1:{port}",
               HSDJAX_NUM_PROCESSES="2")
    code = "from tests.test_sharding import _multihost_worker; _multihost_worker()"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(env, HSDJAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["process"] for r in reports] == [0, 1] and all(r["devices"] == 8 for r in reports)
    for r in reports:
        assert r["ar"] == r["reference"] and r["pld"] == r["reference"]


# ------------------------------------------------------------------------------------------ the workers
class _StubTokenizer:
    """Enough of ``Tokenizer`` for ``Generator`` on token-id prompts, and for ``generate_data`` on
    prompts written as space-separated token ids."""

    stop_ids = ()
    _byte_level = False
    has_chat_template = False

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _model(cfg: ModelConfig, params: dict, mesh: str | None):
    from hsdjax.frontends.api import LoadedModel

    m = sharding.make_mesh(mesh)
    return LoadedModel("tiny", cfg, sharding.shard_params(cfg, params, m), _StubTokenizer(), None,
                       "tiny-sharding-test", {}, m)


def _prefill_check(cfg: ModelConfig, params: dict, mesh: str) -> dict:
    """``engine.prefill`` of two prompts on one device and on ``mesh``: the LM head's logits at every
    prompt position, the KV cache, and how the sharded cache is split."""
    from hsdjax.core import engine
    from hsdjax.core.sampling import SamplingParams
    from hsdjax.runtime.model import Transformer

    prompt = np.zeros((2, 32), np.int32)
    prompt[:, :11] = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11))
    inputs = dict(prompt=prompt, prompt_len=np.array([11, 7], np.int32), max_new=np.full((2,), 4, np.int32),
                  sampling=SamplingParams.make(2, 0.0, 0, 1.0), keys=np.zeros((2, 2), np.uint32),
                  stop_ids=np.asarray(engine.stop_array([])))
    head = jax.jit(lambda p, h: Transformer(cfg).apply({"params": p}, h, method=Transformer.logits))

    def run(m):
        placed = sharding.shard_params(cfg, params, m)
        gen, fwd = engine.prefill(placed, *sharding.place_inputs(inputs, m).values(), cfg=cfg, cache_size=256)
        k = gen.cache.k[-1] if isinstance(gen.cache.k, tuple) else gen.cache.k
        return np.asarray(head(placed, fwd.hidden))[:, :11], k

    (single, k1), (sharded, k8) = run(None), run(sharding.make_mesh(mesh))
    return {"max_abs_diff": float(np.max(np.abs(sharded - single))),
            "argmax_equal": bool((sharded.argmax(-1) == single.argmax(-1)).all()),
            "cache_max_abs_diff": float(np.max(np.abs(np.asarray(k8) - np.asarray(k1)))),
            "cache_shard": list(k8.sharding.shard_shape(k8.shape))}


def _random_drafter(folder: Path, method: str, params: dict) -> Path:
    """A random (untrained) ``method`` drafter checkpoint for the HEADS8 target, its 2-D weights
    scaled up so its proposals vary (what it proposes does not matter: greedy output must not change)."""
    from hsdjax.core.drafters.checkpoint import save_drafter
    from hsdjax.core.drafters.feature import FeatureConfig, init_net
    from hsdjax.train.datagen import fused_layer_indices

    fc = FeatureConfig(method=method, hidden=HEADS8.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=32, vocab=40,
                       rope_theta=HEADS8.rope_theta)
    net = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim == 2 else a, init_net(fc, seed=1))
    ids = np.sort(np.random.RandomState(1).choice(HEADS8.vocab_size, fc.vocab, replace=False)).astype(np.int32)
    layers = fused_layer_indices(HEADS8.num_layers)[:3]
    return save_drafter(folder / f"{method}.safetensors", fc, net, ids, layers, _model(HEADS8, params, None), {})


def _feature_check(params: dict, prompts: list, folder: Path, lap) -> dict:
    """Greedy ``hsd`` / ``eagle`` through ``Generator(..., drafter=PATH)`` on one device and on each mesh."""
    from hsdjax.frontends.api import Generator

    out: dict = {}
    for method in ("hsd", "eagle"):
        path = _random_drafter(folder, method, params)
        for mesh in (None, *MESHES):
            gen = Generator(_model(HEADS8, params, mesh), method, drafter=str(path), depth=3, width=2, budget=4)
            results = gen.generate(prompts, max_new_tokens=12)
            stats = results[0].to_json()
            out[f"{method}@{mesh}"] = {
                "tokens": [r.tokens for r in results], "devices": stats["devices"], "mesh": stats["mesh"],
                "drafter_states": sum(r.stats["drafter_states"] for r in results),
                "dparams_replicated": all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 8
                                          for a in jax.tree_util.tree_leaves(gen.dparams)) if mesh else None}
            lap(f"{method}@{mesh}")
    return out


def _sps_check(params: dict, prompts: list, lap) -> dict:
    """Greedy ``sps`` (a draft LM of HEADS8's shape, the target's weights times 1 + 5% noise) through
    ``Generator.with_drafter`` on one device and on each mesh."""
    from hsdjax.core.drafters.sps import DraftLMDrafter
    from hsdjax.frontends.api import Generator

    rng = np.random.RandomState(8)
    draft = jax.tree_util.tree_map(lambda a: a * (1 + 0.05 * rng.standard_normal(a.shape)).astype(a.dtype), params)
    out: dict = {}
    for mesh in (None, *MESHES):
        gen = Generator.with_drafter(_model(HEADS8, params, mesh), DraftLMDrafter(draft_cfg=HEADS8, depth=3), draft)
        results = gen.generate(prompts, max_new_tokens=12)
        stats = results[0].to_json()
        out[f"sps@{mesh}"] = {
            "tokens": [r.tokens for r in results], "devices": stats["devices"], "mesh": stats["mesh"],
            "accepted_drafts": sum(r.stats["accepted_drafts"] for r in results),
            "tokens_per_pass": stats["mean_accepted_length"],
            "dparams_replicated": all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 8
                                      for a in jax.tree_util.tree_leaves(gen.dparams)) if mesh else None}
        lap(f"sps@{mesh}")
    return out


def _datagen_check(params: dict, folder: Path) -> tuple[dict, dict]:
    """``generate_data`` (the target answers 16 prompts, 8 per batch) on one device and on
    data=2,model=4; returns the comparison and the single-device data."""
    from hsdjax.train.datagen import generate_data, load_shards

    rng = np.random.RandomState(7)
    lines = [json.dumps({"prompt": " ".join(map(str, rng.randint(0, HEADS8.vocab_size, 3 + i % 9)))})
             for i in range(16)]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    data_cfg = {"prompts": str(folder / "prompts.jsonl"), "token_budget": 10**6, "batch": 8, "max_new_tokens": 16,
                "top_k_logits": 4, "max_prompt_tokens": 64}
    runs = {}
    for mesh in (None, "data=2,model=4"):
        generate_data(_model(HEADS8, params, mesh), data_cfg, folder / f"data-{mesh}", progress=False)
        runs[mesh] = load_shards(folder / f"data-{mesh}")
        runs[mesh].pop("manifest")
    one, sharded = runs[None], runs["data=2,model=4"]
    states = np.abs(one["states"].astype(np.float32) - sharded["states"].astype(np.float32))
    return {"tokens": int(one["tokens"].shape[0]),
            "tokens_equal": bool(np.array_equal(one["tokens"], sharded["tokens"])),
            "answer_equal": bool(np.array_equal(one["answer"], sharded["answer"])),
            "states_max_abs_diff": float(states.max()),
            "top_ids_agree": float(np.mean(one["top_ids"] == sharded["top_ids"]))}, one


def _max_rel_diff(a: Any, b: Any) -> float:
    """Largest max|a - b| / max|b| over the leaves of two trees (each leaf relative to its own scale)."""
    def rel(x: Any, y: Any) -> float:
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-12))

    return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(rel, a, b)))


def _train_check(params: dict, data: dict, folder: Path, lap) -> dict:
    """Data-parallel drafter training vs one device, and orbax checkpoints moved between meshes."""
    import shutil

    import orbax.checkpoint as ocp

    from hsdjax.core.drafters.checkpoint import frozen_from_params
    from hsdjax.core.drafters.feature import FeatureConfig, init_net
    from hsdjax.train import train as tr

    fc = FeatureConfig(method="hsd", hidden=HEADS8.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=32, vocab=32,
                       rope_theta=HEADS8.rope_theta)
    vocab_ids = tr.draft_vocab(data["top_ids"], fc.vocab, HEADS8.vocab_size)
    frozen = frozen_from_params(params, HEADS8)
    frozen = {"embed": np.asarray(frozen["embed"]), "head": np.asarray(frozen["head_full"])[vocab_ids],
              "final_norm": np.asarray(frozen["final_norm"])}
    opts = dict(window=16, batch=8, rollout=2, epochs=4, lr=3e-3, warmup=1, holdout=0.15, max_steps=2)
    mesh4, mesh2 = sharding.make_mesh("data=4,model=2"), sharding.make_mesh("data=2,model=4")
    out: dict = {}

    # one loss-and-gradient step, full precision
    vocab_map = np.full((HEADS8.vocab_size,), -1, np.int32)
    vocab_map[vocab_ids] = np.arange(fc.vocab, dtype=np.int32)
    windows = tr.WindowData(data, vocab_map, 16, 0.3, np.unique(data["doc"]))
    batch = windows.batch(windows.starts[:8])
    static = {"rollout": 2, "step_decay": 0.8, "ce_weight": 1.0, "reg_weight": 0.2}

    def grad(p, b, f):
        return jax.value_and_grad(lambda *a: tr.rollout_loss(*a, fc, static)[0])(p, b, f)

    net = init_net(fc, 0)
    l1, g1 = tr.jit_step(grad, None, 1, 3)(net, batch, frozen)
    placed = tr.place_batch(batch, mesh4)
    l4, g4 = tr.jit_step(grad, mesh4, 1, 3)(tr.place_replicated(net, mesh4), placed,
                                             tr.place_replicated(frozen, mesh4))
    out["batch_shard"] = list(placed["tokens"].sharding.shard_shape(placed["tokens"].shape))
    out["step_loss"] = {"single": float(l1), "mesh": float(l4)}
    out["grads_max_rel_diff"] = _max_rel_diff(g4, g1)
    lap("train: one step")

    logs: list[str] = []

    def run(mesh, name: str, **more):
        return tr.train(fc, data, frozen, vocab_ids, dict(opts, **more), folder / name, progress=False,
                        log=logs.append, mesh=mesh)

    single, dp4 = run(None, "single"), run(mesh4, "dp4")
    out["history_single"] = [h[k] for h in single["history"] for k in ("train_loss", "loss")]
    out["history_mesh"] = [h[k] for h in dp4["history"] for k in ("train_loss", "loss")]
    out["params_max_rel_diff"] = _max_rel_diff(dp4["params"], single["params"])
    out["params_replicated"] = all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 8
                                   for a in jax.tree_util.tree_leaves(dp4["params"]))
    lap("train: single and data=4")

    saved = run(mesh2, "dp2")  # checkpoint at step 2, written from a data=2,model=4 mesh
    for name in ("to4", "to1", "probe"):
        shutil.copytree(folder / "dp2", folder / name)
    fresh = tr.place_replicated(init_net(fc, 5), mesh4)  # what a run on data=4,model=2 would start from
    optimizer = tr.make_optimizer({**tr.TRAIN_DEFAULTS, **opts}, 2)
    template = {"params": fresh, "opt_state": tr.place_replicated(optimizer.init(fresh), mesh4), "step": 0}
    full = tr.restore_checkpoint(ocp.CheckpointManager((folder / "probe").resolve()), 2, template)
    restore = {"restored_equal_saved": _max_rel_diff(full["params"], saved["params"]) == 0.0,
               "restored_on_new_mesh": all(a.sharding.is_fully_replicated and a.sharding.mesh.shape == mesh4.shape
                                           for a in jax.tree_util.tree_leaves(full)
                                           if isinstance(a, jax.Array))}
    resumed = []
    for mesh, name in ((mesh4, "to4"), (None, "to1")):
        logs.clear()
        resumed.append(run(mesh, name, max_steps=3))
        restore.setdefault("resumed_logs", []).append(any("resumed from step 2" in m for m in logs))
    restore["steps"] = [r["steps"] for r in resumed]
    restore["continued_max_rel_diff"] = _max_rel_diff(resumed[0]["params"], resumed[1]["params"])
    out["restore"] = restore
    lap("train: checkpoint across meshes")
    return out


def _worker() -> None:
    """The 8-device checks (run in a subprocess by the ``eight_devices`` fixture); prints JSON."""
    from hsdjax.frontends.api import Generator, enable_compilation_cache
    from hsdjax.runtime.model import init_params

    t0, times = time.perf_counter(), {}

    def lap(name: str) -> None:  # seconds since start, reported for tuning the test's cost
        times[name] = round(time.perf_counter() - t0, 1)

    enable_compilation_cache()
    assert jax.device_count() == 8, jax.devices()
    p8, p3 = init_params(HEADS8, seed=3), init_params(HEADS3, seed=4)
    report: dict = {"devices": jax.device_count(), "times": times}
    lap("start")
    report["prefill"] = {"heads8": _prefill_check(HEADS8, p8, "data=2,model=4"),
                         "heads3": _prefill_check(HEADS3, p3, "data=2,model=4")}
    lap("prefill")

    rng = np.random.RandomState(5)
    prompts = []
    for n in range(8):  # repetitive prompts, so prompt lookup finds matches; batch 8 splits on data
        motif = rng.randint(0, HEADS8.vocab_size, 3 + n % 4).tolist()
        prompts.append((motif * 4)[: 6 + 2 * n])
    options = {"ar": {}, "pld": {"depth": 3, "width": 1}}
    greedy: dict = {}
    ref = Generator(_model(HEADS8, p8, None), "ar").generate(prompts, max_new_tokens=12)
    greedy["reference"] = [r.tokens for r in ref]
    lap("reference")
    for mesh in MESHES:
        for method in ("ar", "pld"):
            gen = Generator(_model(HEADS8, p8, mesh), method, **options[method])
            results = gen.generate(prompts, max_new_tokens=12)
            stats = results[0].to_json()
            lap(f"{method}@{mesh}")
            greedy[f"{method}@{mesh}"] = {"tokens": [r.tokens for r in results], "devices": stats["devices"],
                                          "mesh": stats["mesh"], "tokens_per_pass": stats["mean_accepted_length"]}
            if method == "ar" and mesh == "data=2,model=4":  # repeated calls of one compiled decode program
                "".join(gen.stream(prompts[0], max_new_tokens=12, chunk_steps=5))
                greedy[f"stream@{mesh}"] = gen.last_result.tokens
                lap("stream")
    report["greedy"] = greedy
    with tempfile.TemporaryDirectory() as tmp:
        report["feature"] = _feature_check(p8, prompts, Path(tmp), lap)
        report["sps"] = _sps_check(p8, prompts, lap)
        report["datagen"], data = _datagen_check(p8, Path(tmp))
        lap("datagen")
        report["train"] = _train_check(p8, data, Path(tmp), lap)
    print(json.dumps(report))


def _multihost_worker() -> None:
    """One process of ``test_two_processes_share_one_mesh``; prints JSON."""
    sharding.maybe_initialize_distributed()  # HSDJAX_COORDINATOR is set: joins before JAX starts
    from hsdjax.frontends.api import Generator
    from hsdjax.runtime.model import init_params

    params = init_params(HEADS8, seed=3)
    rng = np.random.RandomState(6)
    prompts = [(rng.randint(0, HEADS8.vocab_size, 3).tolist() * 5)[: 5 + 2 * i] for i in range(4)]
    single = Generator(_model(HEADS8, params, None), "ar").generate(prompts, max_new_tokens=10)
    report = {"process": jax.process_index(), "devices": jax.device_count(), "reference": [r.tokens for r in single]}
    for method, options in (("ar", {}), ("pld", {"depth": 3, "width": 1})):
        gen = Generator(_model(HEADS8, params, "data=2,model=4"), method, **options)
        report[method] = [r.tokens for r in gen.generate(prompts, max_new_tokens=10)]
    print(json.dumps(report))
