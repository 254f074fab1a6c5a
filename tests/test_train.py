"""Drafter training end to end on a tiny target: recorded self-distillation data, rollout training
that learns (held-out acceptance rises), resume, export, and the trained drafter in the engine."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from hsdjax.core.drafters.checkpoint import frozen_from_params, load_drafter, save_drafter
from hsdjax.core.drafters.feature import FeatureConfig
from hsdjax.errors import HsdjaxError
from hsdjax.runtime.model import init_params
from hsdjax.train.datagen import RecordingDrafter, flatten_recorded, fused_layer_indices
from hsdjax.train.train import WindowData, document_span, draft_vocab, train
from tests.conftest import TINY_LLAMA, run_engine

CFG = TINY_LLAMA


@pytest.fixture(scope="module")
def recorded():
    """Greedy answers of the tiny target to 24 random prompts, recorded like `train-drafter` does."""
    params = init_params(CFG, seed=1)
    layers = fused_layer_indices(CFG.num_layers)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, CFG.vocab_size, rng.randint(3, 12))) for _ in range(24)]
    drafter = RecordingDrafter(layers=layers, top_k=4)
    dparams = {"head": frozen_from_params(params, CFG)["head_full"]}
    _, state = run_engine(CFG, params, prompts, 48, drafter=drafter, dparams=dparams, return_state=True)
    data = flatten_recorded(state, [len(p) for p in prompts])
    data["states"] = data["states"].view(jax.numpy.bfloat16)
    return params, layers, prompts, data


def frozen_pieces(params, data, fc):
    """The draft vocabulary for ``fc`` from the recorded top-k, and the target pieces training reads."""
    vocab_ids = draft_vocab(data["top_ids"], fc.vocab, CFG.vocab_size)
    frozen = frozen_from_params(params, CFG)
    return vocab_ids, {"embed": np.asarray(frozen["embed"]), "head": np.asarray(frozen["head_full"])[vocab_ids],
                       "final_norm": np.asarray(frozen["final_norm"])}


def test_recorded_states_match_a_teacher_forced_pass(recorded):
    """What the recording drafter stored during decoding equals a fresh forward over the sequence."""
    import jax.numpy as jnp

    from hsdjax.runtime.model import Transformer, causal_mask

    params, layers, prompts, data = recorded
    doc0 = data["doc"] == 0
    toks = data["tokens"][doc0]
    t = len(toks)
    fwd = Transformer(CFG).apply({"params": params}, jnp.asarray(toks)[None], jnp.arange(t)[None],
                                 causal_mask(jnp.array([t]), t))
    want = np.stack([np.asarray(fwd["layers"][i][0]) for i in layers], axis=1)
    got = np.asarray(data["states"][doc0], np.float32)
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0.02)  # bfloat16 storage
    logits = np.asarray(Transformer(CFG).apply({"params": params}, fwd["hidden"], method=Transformer.logits))[0]
    assert np.array_equal(data["top_ids"][doc0][:, 0], logits.argmax(-1))


@pytest.mark.parametrize("method", ["hsd", "eagle", "hsd-attn"])
def test_training_learns_resumes_and_drafts(recorded, tmp_path, method):
    params, layers, prompts, data = recorded
    method, _, injection = method.partition("-")  # hsd-attn: g also reads the context (and is wider)
    fc = FeatureConfig(method=method, hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64,
                       vocab=64, rope_theta=CFG.rope_theta, injection=injection or "mlp",
                       inject_hidden=96 if injection else 0)
    vocab_ids, frozen_np = frozen_pieces(params, data, fc)
    opts = dict(window=32, batch=8, rollout=3, epochs=20, lr=3e-3, warmup=5, holdout=0.15, max_steps=30)
    logs = []
    first = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "ckpt", progress=False, log=logs.append)
    hist = first["history"]
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["chain_accept"] > hist[0]["chain_accept"]
    more = train(fc, data, frozen_np, vocab_ids, dict(opts, max_steps=40), tmp_path / "ckpt", progress=False,
                 log=logs.append)
    assert any("resumed from step 30" in m for m in logs) and more["steps"] == 40, logs
    with pytest.raises(HsdjaxError, match="other data or settings.*window 32 -> 16"):  # never a silent mix
        train(fc, data, frozen_np, vocab_ids, dict(opts, window=16), tmp_path / "ckpt", progress=False)

    target = types.SimpleNamespace(name="tiny", fingerprint="f" * 64, params=params, cfg=CFG)
    path = save_drafter(tmp_path / "d.safetensors", fc, more["params"], vocab_ids, layers[:-1], target, {"x": 1})
    cfg2, layers2, dparams, meta = load_drafter(path, target, method)
    assert cfg2 == fc and meta["info"] == {"x": 1}
    from hsdjax.core.drafters.eagle import EagleDrafter
    from hsdjax.core.drafters.hsd import HSDDrafter

    cls = HSDDrafter if method == "hsd" else EagleDrafter
    drafter = cls(cfg=cfg2, layers=layers2, depth=4, width=2, budget=6)
    want = run_engine(CFG, params, prompts[:4], 40)
    got, state = run_engine(CFG, params, prompts[:4], 40, drafter=drafter, dparams=dparams, return_state=True)
    assert got == want
    s = jax.tree_util.tree_map(np.asarray, state.stats)
    assert s.accepted_drafts.sum() > 0.3 * s.target_passes.sum()  # the trained drafter is right often

    other = types.SimpleNamespace(name="other", fingerprint="0" * 64, params=params, cfg=CFG)
    with pytest.raises(HsdjaxError, match="was trained for tiny"):
        load_drafter(path, other, method)
    with pytest.raises(HsdjaxError, match="not hsd|not eagle"):
        load_drafter(path, target, "eagle" if method == "hsd" else "hsd")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_training_run_saves_its_steps_and_resumes_from_them(recorded, tmp_path, how):
    """Ctrl-C, or a real SIGTERM to this process (``kill``, a session ending; a job started with ``&``
    ignores SIGINT), between the periodic saves keeps the steps done so far: the interrupt comes from the
    log call after the first epoch's evaluation, before that epoch's save. Training puts the previous
    SIGTERM handler back afterwards."""
    import os
    import signal

    params, layers, prompts, data = recorded
    fc = FeatureConfig(method="hsd", hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                       rope_theta=CFG.rope_theta)
    vocab_ids, frozen_np = frozen_pieces(params, data, fc)
    opts = dict(window=32, batch=8, rollout=2, epochs=3, lr=3e-3, warmup=2, holdout=0.15, save_every_s=1e9)
    logs = []

    def interrupt_after_first_epoch(msg):
        logs.append(msg)
        if msg.startswith("step "):
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "ckpt", progress=False, log=interrupt_after_first_epoch)
    assert signal.getsignal(signal.SIGTERM) is before
    first_epoch = int(logs[0].split()[1].rstrip(":"))
    assert any(m.startswith(f"interrupted: saving step {first_epoch}") for m in logs), logs
    done = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "ckpt", progress=False, log=logs.append)
    assert any(f"resumed from step {first_epoch}" in m for m in logs), logs
    assert done["steps"] == 3 * first_epoch


@pytest.mark.parametrize("method", ["hsd", "eagle"])
def test_a_narrow_drafter_trains_loads_counts_its_work_and_is_lossless(recorded, tmp_path, method):
    """``width`` < the target's E: the layer runs W wide, ``lift`` maps its states to E for the head
    and the regression; fewer parameters, the work counter equals its matrices, still lossless."""
    from hsdjax.core.drafters.eagle import EagleDrafter
    from hsdjax.core.drafters.feature import init_net
    from hsdjax.core.drafters.hsd import HSDDrafter

    params, layers, prompts, data = recorded
    wide = FeatureConfig(method=method, hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                         rope_theta=CFG.rope_theta)
    fc = FeatureConfig(**{**wide.to_json(), "width": 16})
    count = lambda p: sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(p))  # noqa: E731
    net = init_net(fc)
    assert net["lift"].shape == (16, CFG.hidden_size) and net["layer"]["wq"].shape == (16, 16)
    assert count(net) < 0.6 * count(init_net(wide))
    cls = HSDDrafter if method == "hsd" else EagleDrafter
    d = cls(cfg=fc, layers=layers[:-1])
    # one token's work (no attention keys) is exactly the multiply-adds of its matrices and the head
    matrices = sum(int(np.prod(a.shape)) for path, a in jax.tree_util.tree_leaves_with_path(net)
                   if a.ndim == 2 and not path[-1].key.endswith("norm"))
    per_token = d._input_macs() + d._layer_macs(0) + d._head_macs() + (d._inject_macs() if method == "hsd" else 0)
    assert per_token == matrices + fc.vocab * fc.hidden

    vocab_ids, frozen_np = frozen_pieces(params, data, fc)
    opts = dict(window=32, batch=8, rollout=3, epochs=20, lr=3e-3, warmup=5, holdout=0.15, max_steps=30)
    out = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "ckpt", progress=False, log=lambda m: None)
    assert out["history"][-1]["loss"] < out["history"][0]["loss"]
    target = types.SimpleNamespace(name="tiny", fingerprint="f" * 64, params=params, cfg=CFG)
    path = save_drafter(tmp_path / "d.safetensors", fc, out["params"], vocab_ids, layers[:-1], target, {})
    cfg2, layers2, dparams, _ = load_drafter(path, target, method)
    assert cfg2 == fc and cfg2.state_width == 16
    drafter = cls(cfg=cfg2, layers=layers2, depth=3, width=2, budget=4)
    got, state = run_engine(CFG, params, prompts[:3], 32, drafter=drafter, dparams=dparams, return_state=True)
    assert got == run_engine(CFG, params, prompts[:3], 32)
    assert np.asarray(state.stats.accepted_drafts).sum() > 0


def test_drafter_width_is_checked_against_the_target_before_any_work():
    from hsdjax.train.pipeline import drafter_heads

    assert drafter_heads(CFG, 0) == (CFG.num_heads, CFG.num_kv_heads)
    assert drafter_heads(CFG, 16) == (2, 2)  # the target's head size; its kv grouping where it divides
    assert drafter_heads(CFG, 24) == (3, 1)
    for bad in (20, 56, -8):
        with pytest.raises(HsdjaxError, match="multiple of the target's head size 8 and at most its hidden size 48"):
            drafter_heads(CFG, bad)


def test_window_data_views_the_stream_without_copying():
    """Train and held-out documents are slices of the flat stream: the big state array is shared, not copied."""
    doc = np.repeat(np.arange(6, dtype=np.int32), [3, 1, 4, 2, 5, 2])
    n = len(doc)
    data = {"doc": doc, "tokens": np.arange(n, dtype=np.int32), "answer": np.ones(n, bool),
            "states": np.random.default_rng(0).normal(size=(n, 2, 4)).astype(np.float32),
            "top_logits": np.zeros((n, 2), np.float32), "top_ids": np.zeros((n, 2), np.int32)}
    assert document_span(doc, np.arange(2, 5)) == slice(4, 15)
    with pytest.raises(ValueError):
        document_span(doc, np.array([1, 3]))
    held = WindowData(data, np.arange(4, dtype=np.int32), 4, 0.3, np.arange(4, 6))
    assert np.shares_memory(held.states, data["states"])
    np.testing.assert_array_equal(held.tokens, np.arange(10, 17))
    np.testing.assert_array_equal(held.doc, doc[10:])


def test_feature_noise_is_bounded_per_state_and_reproducible():
    from hsdjax.train.train import add_feature_noise

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3, 16)) * jax.numpy.arange(1, 4)[None, None, :, None]
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    y = np.asarray(add_feature_noise(x, keys, 0.1))
    rms = np.sqrt(np.mean(np.square(np.asarray(x)), axis=-1, keepdims=True))
    d = np.abs(y - np.asarray(x))
    assert (d <= 0.1 * rms + 1e-6).all() and d.mean() > 0.02 * rms.mean()  # scaled to each state, not zero
    np.testing.assert_array_equal(y, np.asarray(add_feature_noise(x, keys, 0.1)))  # same keys, same noise
    # a row's noise depends only on its own key (independent of how rows are split over devices)
    np.testing.assert_array_equal(y[1:], np.asarray(add_feature_noise(x[1:], keys[1:], 0.1)))


def test_training_with_feature_noise_learns_and_is_reproducible(recorded, tmp_path):
    params, layers, prompts, data = recorded
    fc = FeatureConfig(method="hsd", hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                       rope_theta=CFG.rope_theta)
    vocab_ids, frozen_np = frozen_pieces(params, data, fc)
    opts = dict(window=32, batch=8, rollout=2, epochs=20, lr=3e-3, warmup=5, holdout=0.15, max_steps=24,
                feature_noise=0.1)
    whole = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "a", progress=False, log=lambda m: None)
    assert whole["history"][-1]["loss"] < whole["history"][0]["loss"]
    again = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "b", progress=False, log=lambda m: None)
    flat = lambda t: np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(t)])  # noqa: E731
    np.testing.assert_allclose(flat(again["params"]), flat(whole["params"]), rtol=1e-5, atol=1e-6)  # noise from (seed, step)
    clean = train(fc, data, frozen_np, vocab_ids, dict(opts, feature_noise=0.0), tmp_path / "c", progress=False,
                  log=lambda m: None)
    assert not np.allclose(flat(clean["params"]), flat(whole["params"]))  # the noise reached the training


def test_trained_head_correction_is_learned_saved_and_folded_into_the_head(recorded, tmp_path):
    """``head_delta``: training learns a correction to the frozen head rows; the checkpoint stores it and
    loading adds it to the rows once (the drafter then runs as fast as with a frozen head, and stays
    lossless)."""
    import ml_dtypes

    from hsdjax.core.drafters.hsd import HSDDrafter

    params, layers, prompts, data = recorded
    fc = FeatureConfig(method="hsd", hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                       rope_theta=CFG.rope_theta, head_delta=True)
    vocab_ids = draft_vocab(data["top_ids"], fc.vocab, CFG.vocab_size)
    frozen = frozen_from_params(params, CFG)
    rows = np.asarray(frozen["head_full"])[vocab_ids]
    frozen_np = {"embed": np.asarray(frozen["embed"]), "head": rows, "final_norm": np.asarray(frozen["final_norm"])}
    opts = dict(window=32, batch=8, rollout=2, epochs=20, lr=3e-3, warmup=5, holdout=0.15, max_steps=24)
    out = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "ckpt", progress=False, log=lambda m: None)
    delta = np.asarray(out["params"]["head_delta"])
    assert delta.shape == rows.shape and np.abs(delta).max() > 1e-3  # it learned a correction
    assert out["history"][-1]["loss"] < out["history"][0]["loss"]

    target = types.SimpleNamespace(name="tiny", fingerprint="f" * 64, params=params, cfg=CFG)
    path = save_drafter(tmp_path / "d.safetensors", fc, out["params"], vocab_ids, layers[:-1], target, {})
    cfg2, layers2, dparams, _ = load_drafter(path, target, "hsd")
    assert cfg2.head_delta and "head_delta" not in dparams["net"]
    stored = delta.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(np.asarray(dparams["head"]), rows + stored, rtol=1e-6, atol=1e-6)
    drafter = HSDDrafter(cfg=cfg2, layers=layers2, depth=3, width=2, budget=4)
    got = run_engine(CFG, params, prompts[:3], 32, drafter=drafter, dparams=dparams)
    assert got == run_engine(CFG, params, prompts[:3], 32)


def test_training_can_start_from_a_trained_drafter(recorded, tmp_path):
    """The train setting ``init``: a run starts from an exported drafter's weights and draft vocabulary
    (more data for a trained drafter); a checkpoint of another shape or other layers is refused."""
    from hsdjax.core.drafters.checkpoint import warm_start

    params, layers, prompts, data = recorded
    fc = FeatureConfig(method="hsd", hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                       rope_theta=CFG.rope_theta)
    vocab_ids, frozen_np = frozen_pieces(params, data, fc)
    opts = dict(window=32, batch=8, rollout=2, epochs=20, lr=3e-3, warmup=5, holdout=0.15, max_steps=30)
    trained = train(fc, data, frozen_np, vocab_ids, opts, tmp_path / "a", progress=False, log=lambda m: None)
    target = types.SimpleNamespace(name="tiny", fingerprint="f" * 64, params=params, cfg=CFG)
    path = save_drafter(tmp_path / "d.safetensors", fc, trained["params"], vocab_ids[::-1], layers[:-1], target,
                        {"steps": 30})
    got_vocab, net, meta = warm_start(path, fc, layers[:-1], target)
    assert np.array_equal(got_vocab, vocab_ids[::-1]) and meta["info"] == {"steps": 30}

    frozen_rev = dict(frozen_np, head=frozen_np["head"][::-1])  # the rows of the checkpoint's vocabulary order
    still = dict(opts, lr=0.0, max_steps=1, init=str(path))  # no update: the weights stay those loaded
    warm = train(fc, data, frozen_rev, got_vocab, still, tmp_path / "b", progress=False, log=lambda m: None,
                 init_params=net)
    cold = train(fc, data, frozen_rev, got_vocab, dict(still, init=""), tmp_path / "c", progress=False,
                 log=lambda m: None)
    for k, v in jax.tree_util.tree_leaves_with_path(net):
        got = warm["params"]
        for key in k:
            got = got[key.key]
        np.testing.assert_array_equal(np.asarray(got), v)
    assert warm["history"][-1]["chain_accept"] > cold["history"][-1]["chain_accept"] + 0.2
    start = warm["history"][0]  # the starting point is evaluated on the same held-out windows before any step
    assert start["step"] == 0 and start["chain_accept"] == pytest.approx(warm["history"][-1]["chain_accept"])
    assert cold["history"][0]["step"] == 1
    assert warm["history"][-1]["loss"] < cold["history"][-1]["loss"]

    # growing a trained hsd (root_token: token weights at zero; chain_layer: the chain's layer a copy of the
    # one layer; chain_g: the chain's g and norms copies) starts where the drafter was
    for added in ("root_token", "chain_layer", "chain_g"):
        grown_fc = FeatureConfig(**{**fc.to_json(), added: True})
        _, grown_net, _ = warm_start(path, grown_fc, layers[:-1], target)
        grown = train(grown_fc, data, frozen_rev, got_vocab, still, tmp_path / added, progress=False,
                      log=lambda m: None, init_params=grown_net)
        assert grown["history"][0]["loss"] == pytest.approx(start["loss"], rel=1e-5), added
        assert grown["history"][0]["chain_accept"] == pytest.approx(start["chain_accept"]), added

    with pytest.raises(HsdjaxError, match="another drafter shape.*mlp 64 there, 32 here"):
        warm_start(path, FeatureConfig(**{**fc.to_json(), "mlp": 32}), layers[:-1], target)
    with pytest.raises(HsdjaxError, match="reads target layers"):
        warm_start(path, fc, layers[:-1][::-1] + (99,), target)
    other = types.SimpleNamespace(name="other", fingerprint="0" * 64, params=params, cfg=CFG)
    with pytest.raises(HsdjaxError, match="was trained for tiny"):
        warm_start(path, fc, layers[:-1], other)
    with pytest.raises(HsdjaxError, match="do not fit this drafter"):
        train(fc, data, frozen_rev, got_vocab, still, tmp_path / "d", progress=False, log=lambda m: None,
              init_params=dict(list(net.items())[1:]))


def chain_training_setup(recorded, **settings):
    """(config, batch, frozen pieces, fresh params, loss options) of a tiny `hsd` with ``settings``."""
    import jax.numpy as jnp

    from hsdjax.core.drafters.feature import init_net

    params, layers, prompts, data = recorded
    fc = FeatureConfig(method="hsd", hidden=CFG.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=64, vocab=64,
                       rope_theta=CFG.rope_theta, **settings)
    vocab_ids, frozen = frozen_pieces(params, data, fc)
    vocab_map = np.full(CFG.vocab_size, -1, np.int64)
    vocab_map[vocab_ids] = np.arange(len(vocab_ids))
    windows = WindowData(data, vocab_map, 32, 0.1, np.unique(data["doc"]))
    batch = jax.tree_util.tree_map(jnp.asarray, windows.batch(windows.starts[:4]))
    return fc, batch, frozen, init_net(fc, 0), dict(step_decay=0.8, ce_weight=1.0, reg_weight=0.2, feature_noise=0.0)


def sum_of_squares(tree):
    return sum(float(np.sum(np.square(np.asarray(a)))) for a in jax.tree_util.tree_leaves(tree))


def test_the_chain_layer_is_trained_by_the_rollout_steps_alone(recorded):
    """With ``chain_layer``, rollout step 1 (verified inputs) trains the first layer and steps 2+ (the
    drafter's own states) the second: at rollout 1 no gradient reaches the chain's layer, at rollout 2
    it does; the chain's layer changes step 2's loss but not step 1's. With ``detach_chain`` the first
    layer and the fusion get step 1's gradient alone."""
    from hsdjax.train.train import rollout_loss

    fc, batch, frozen, net, opts = chain_training_setup(recorded, chain_layer=True)
    norm = sum_of_squares

    def grads(rollout):
        return jax.grad(lambda p: rollout_loss(p, batch, frozen, fc, dict(opts, rollout=rollout))[0])(net)

    one, two = grads(1), grads(2)
    assert norm(one["chain"]) == 0 and norm(one["layer"]) > 0
    assert all(norm(g) > 0 for g in two["chain"].values())  # every piece of it: projections, output, MLP
    # detach_chain: the first layer and the fusion get step 1's gradient alone, as at rollout 1
    cut = jax.grad(lambda p: rollout_loss(p, batch, frozen, fc, dict(opts, rollout=3, detach_chain=True))[0])(net)
    first = lambda g: {k: g[k] for k in ("layer", "fuse", "fuse_norm")}  # noqa: E731
    for a, b in zip(jax.tree_util.tree_leaves(first(one)), jax.tree_util.tree_leaves(first(cut))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert not np.allclose(first(one)["layer"]["wq"], first(two)["layer"]["wq"], rtol=1e-3)
    assert all(norm(g) > 0 for g in cut["chain"].values())
    moved = dict(net, chain=jax.tree_util.tree_map(lambda a: a * 1.5 if a.ndim == 2 else a, net["chain"]))
    metrics = [rollout_loss(p, batch, frozen, fc, dict(opts, rollout=2))[1] for p in (net, moved)]
    assert float(metrics[0]["acc_ce1"]) == float(metrics[1]["acc_ce1"])
    assert float(metrics[0]["acc_ce2"]) != float(metrics[1]["acc_ce2"])


def test_with_chain_g_and_detach_chain_the_first_draft_is_trained_as_at_rollout_1(recorded):
    """``chain_g`` gives the chain's states a ``g`` and norms of their own; with ``chain_layer`` and
    ``detach_chain`` every weight the first draft reads (fusion, first layer, ``g``, norms) then gets
    rollout 1's gradient, and the chain's output side is trained by steps 2+ alone."""
    from hsdjax.train.train import rollout_loss

    fc, batch, frozen, net, opts = chain_training_setup(recorded, chain_layer=True, chain_g=True)
    assert set(net["chain_output"]) == {"emb_norm", "out_norm", "g_in", "g_out"}

    def grads(rollout, **more):
        return jax.grad(lambda p: rollout_loss(p, batch, frozen, fc, dict(opts, rollout=rollout, **more))[0])(net)

    one, cut = grads(1), grads(3, detach_chain=True)
    assert sum_of_squares(one["chain_output"]) == 0
    assert all(sum_of_squares(g) > 0 for g in cut["chain_output"].values())
    first_draft = sorted(set(net) - {"chain", "chain_output"})
    assert {"g_in", "g_out", "out_norm", "emb_norm", "layer", "fuse"} <= set(first_draft)
    for name in first_draft:
        for a, b in zip(jax.tree_util.tree_leaves(one[name]), jax.tree_util.tree_leaves(cut[name])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8, err_msg=name)
    moved = dict(net, chain_output={k: v * 1.5 for k, v in net["chain_output"].items()})
    metrics = [rollout_loss(p, batch, frozen, fc, dict(opts, rollout=2))[1] for p in (net, moved)]
    assert float(metrics[0]["acc_ce1"]) == float(metrics[1]["acc_ce1"])
    assert float(metrics[0]["acc_ce2"]) != float(metrics[1]["acc_ce2"])


def test_a_misspelt_config_setting_is_refused_not_ignored(tmp_path):
    import json

    from hsdjax.train.pipeline import read_config

    good = {"target": "smollm2-135m", "method": "hsd", "data": {}, "drafter": {"head_delta": True},
            "train": {"rollout": 6}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(good))
    assert read_config(path)["drafter"]["head_delta"] is True
    for section, key in (("drafter", "head_detla"), ("train", "rolout")):
        path.write_text(json.dumps({**good, section: {key: 1}}))
        with pytest.raises(HsdjaxError, match=f"unknown {section} setting.*'{key}'.*known:"):
            read_config(path)
    path.write_text(json.dumps({**good, "drafter": {"injection": "atn"}}))
    with pytest.raises(HsdjaxError, match="injection 'atn': expected one of mlp, film, attn"):
        read_config(path)
    for key, bad in (("inject_hidden", -1), ("mlp", 0), ("vocab", 40.5), ("width", "wide")):
        path.write_text(json.dumps({**good, "drafter": {key: bad}}))
        with pytest.raises(HsdjaxError, match=f"drafter {key} must be a whole number"):
            read_config(path)
    path.write_text(json.dumps({**good, "drafter": {"inject_tokens": 3}}))
    with pytest.raises(HsdjaxError, match="inject_tokens must be 1 or 2"):
        read_config(path)
    path.write_text(json.dumps({**good, "drafter": {"root_token": "yes"}}))
    with pytest.raises(HsdjaxError, match="root_token must be true or false"):
        read_config(path)
    path.write_text(json.dumps({**good, "method": "eagle", "drafter": {"root_token": True}}))
    with pytest.raises(HsdjaxError, match="root_token is an hsd setting"):
        read_config(path)
    for key in ("chain_layer", "chain_g"):
        path.write_text(json.dumps({**good, "drafter": {key: 1}}))
        with pytest.raises(HsdjaxError, match=f"{key} must be true or false"):
            read_config(path)
        path.write_text(json.dumps({**good, "method": "eagle", "drafter": {key: True}}))
        with pytest.raises(HsdjaxError, match=f"{key} is an hsd setting"):
            read_config(path)
    path.write_text(json.dumps({**good, "drafter": {"chain_layer": True, "root_token": True},
                                "train": {"detach_chain": True}}))
    assert read_config(path)["train"]["detach_chain"] is True
    path.write_text(json.dumps({**good, "train": {"detach_chain": True}}))
    with pytest.raises(HsdjaxError, match="detach_chain needs an hsd drafter with chain_layer"):
        read_config(path)
    path.write_text(json.dumps({**good, "drafter": {"chain_layer": True}, "train": {"detach_chain": "no"}}))
    with pytest.raises(HsdjaxError, match="detach_chain must be true or false"):
        read_config(path)


def test_warm_start_on_seen_data_is_called_out(tmp_path):
    """Same data settings (the budget aside) are the same seeded prompt sequence: a warm start on no more
    answer tokens than its checkpoint saw adds epochs, not data, and the run says so; --new-data-only
    needs a warm start whose data it can place."""
    from hsdjax.train.pipeline import seen_answers, seen_data_note, train_from_config

    data = {"prompts": ["p.jsonl"], "seed": 0, "token_budget": 2_000_000, "max_new_tokens": 256}
    info = {"data_tokens": 2_000_000, "answer_tokens": 1_200_000, "config": {"data": data}}
    seen = seen_data_note(info, {**data, "token_budget": 4_000_000}, 1_100_000)
    assert seen is not None and "all of it" in seen and "1100000" in seen
    grown = seen_data_note(info, {**data, "token_budget": 4_000_000}, 1_700_000)
    assert grown is not None and "500000 are new" in grown and "--new-data-only" in grown
    assert seen_answers(info, {**data, "token_budget": 4_000_000}) == 1_200_000
    assert seen_data_note(info, {**data, "seed": 1}, 1_500_000) is None  # another prompt sequence
    assert seen_answers(info, {**data, "seed": 1}) is None
    assert seen_data_note({"data_tokens": 5}, data, 1_500_000) is None  # a checkpoint without a record
    # a later slice of the same sequence (first_prompt): new when past the checkpoint's recorded last prompt
    spanned = {**info, "prompt_span": [0, 8000]}
    assert seen_answers(spanned, {**data, "first_prompt": 12288}) == 0
    assert "all of it is new" in seen_data_note(spanned, {**data, "first_prompt": 12288}, 900_000)
    assert seen_answers(spanned, {**data, "first_prompt": 6000}) is None  # overlaps what it saw
    assert seen_answers(info, {**data, "first_prompt": 12288}) is None  # no record of where its data ended
    assert "cannot be told" in seen_data_note(info, {**data, "first_prompt": 12288}, 900_000)
    assert seen_data_note(info, {**data, "seed": 1, "first_prompt": 12288}, 900_000) is None  # another sequence
    cfg = {"target": "t", "method": "hsd", "data": data, "name": "x"}
    with pytest.raises(HsdjaxError, match="give --init"):
        train_from_config(cfg, None, tmp_path, out=None, max_steps=1, epochs=None, progress=False, log=print,
                          new_data_only=True)
    with pytest.raises(HsdjaxError, match="not found"):
        train_from_config(cfg, None, tmp_path, out=None, max_steps=1, epochs=None, progress=False, log=print,
                          init=str(tmp_path / "none.safetensors"), new_data_only=True)
