"""Drafter training: multi-step rollout ("training-time test") with optax, orbax checkpoints, resume.

The data are flat token streams with the target's recorded states (see ``datagen``). Training takes
windows of W tokens. Step 1 of the rollout runs the drafter layer causally over the window's fused
target states (within each sequence): its output at t predicts the target's state at t+1. Step s
feeds the previous step's outputs back (``hsd``: the output itself; ``eagle``: with the embedding of
the next true token) at position t+s-1; each query attends to the true context up to t and to its
own earlier rollout inputs, exactly what the drafter sees at inference. At each step the loss is a
soft cross-entropy against the target's top-k distribution over the draft vocabulary (``hsd``:
through ``g`` with the true path tokens; ``attn`` injection: ``g`` also reads the true context up to t) plus a smooth-L1 regression to the target's final state,
weighted by ``step_decay ** (s-1)``; prompt tokens are weighted by ``prompt_weight``. With
``feature_noise`` = a > 0, training (not evaluation) adds uniform noise in [-a, a] times each state's
root mean square to the target states the drafter reads (never to the states it must predict), so
it learns from inputs as imperfect as its own predictions at later steps. With ``detach_chain`` (an
``hsd`` with ``chain_layer``) steps 2+ read step 1's outputs, keys and values as given data: the first
layer (and the fusion) is trained by step 1 alone, the chain's layer by the later steps; with
``chain_g`` too (steps 2+ through the chain's own ``g`` and norms) every weight of the first draft is.

Data parallel: given a ``jax.sharding.Mesh`` (axes ``data``, ``model``), each batch of windows is split
by rows over ``data`` while the drafter's params, the optimizer state and the frozen target pieces are
replicated on every device; the steps are jitted with these shardings, so XLA computes the global
loss and averages the gradients across ``data`` itself (``model`` only adds replicas). Checkpoints
restore onto whatever mesh (or single device) the resuming run uses.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, Shaped

from hsdjax.core.drafters.feature import FeatureConfig, FeatureDrafterNet, draft_head, init_net
from hsdjax.errors import HsdjaxError
from hsdjax.kernels.tree_attention import MASKED_SCORE
from hsdjax.runtime.model import rms_norm
from hsdjax.runtime.weights import flatten

TRAIN_DEFAULTS = {
    "window": 256, "batch": 8, "rollout": 4, "epochs": 2.0, "lr": 1e-3, "warmup": 50, "weight_decay": 0.01,
    "step_decay": 0.8, "ce_weight": 1.0, "reg_weight": 0.2, "prompt_weight": 0.3, "holdout": 0.02,
    "save_every_s": 600, "seed": 0, "max_steps": 0, "feature_noise": 0.0,
    "detach_chain": False,  # hsd with chain_layer: steps 2+ pass no gradient into the first layer (step 1 trains it)
    "init": "",  # a drafter checkpoint to start from (`hsdjax train-drafter`; "shipped": the shipped one)
}


def draft_vocab(top_ids: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` tokens the target predicts most often (top-1), sorted by id."""
    counts = np.bincount(top_ids[:, 0], minlength=vocab_size)
    ids = np.argsort(-counts, kind="stable")[:size]
    return np.sort(ids).astype(np.int32)


def _shift(a: Array, s: int, fill: Any = 0) -> Array:
    """a[:, t + s] at position t (``fill`` past the end)."""
    if s == 0:
        return a
    pad = jnp.full((a.shape[0], s, *a.shape[2:]), fill, a.dtype)
    return jnp.concatenate([a[:, s:], pad], axis=1)


def rollout_attention(q: Float[Array, "B T H D"], k_true: Float[Array, "B T K D"], v_true: Float[Array, "B T K D"],
                      mask: Bool[Array, "B T T"], own_k: list[Array], own_v: list[Array]) -> Float[Array, "B T H D"]:
    """Each query t attends to the true keys its mask allows and to its own rollout keys."""
    b, t, h, d = q.shape
    kv = k_true.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scale = 1 / math.sqrt(d)
    ctx = jnp.einsum("btkgd,bskd->bkgts", qg, k_true) * scale
    ctx = jnp.where(mask[:, None, None], ctx, MASKED_SCORE)
    own = [jnp.einsum("btkgd,btkd->bkgt", qg, k)[..., None] * scale for k in own_k]
    probs = jax.nn.softmax(jnp.concatenate([ctx, *own], axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v_true)
    for i, v in enumerate(own_v):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + i], v)
    return out.reshape(b, t, h, d)


def add_feature_noise(states: Float[Array, "B T F E"], keys: Shaped[Array, "B 2"], amount: float
                      ) -> Float[Array, "B T F E"]:
    """``states`` plus uniform noise in [-amount, amount] times each state's root mean square (one key
    per row, so the noise does not depend on how rows are split over devices)."""
    u = jax.vmap(lambda k: jax.random.uniform(k, states.shape[1:], jnp.float32, -1.0, 1.0))(keys)
    rms = jnp.sqrt(jnp.mean(jnp.square(states), axis=-1, keepdims=True))
    return states + amount * rms * u


def rollout_loss(params: Any, batch: dict[str, Array], frozen: dict[str, Array], cfg: FeatureConfig,
                 opts: dict[str, Any]) -> tuple[Array, dict[str, Array]]:
    """Loss of one batch of windows and per-step metrics (accuracy of the draft's top-1)."""
    net = FeatureDrafterNet(cfg)
    call = lambda method, *a: net.apply({"params": params}, *a, method=method)  # noqa: E731
    head = draft_head(frozen["head"], params)
    tokens, doc, weight = batch["tokens"], batch["doc"], batch["weight"]
    b, t = tokens.shape
    states = batch["states"].astype(jnp.float32)  # [B, T, F+1, E]
    target_h = rms_norm(states[:, :, -1], frozen["final_norm"], cfg.eps)
    inputs = states[:, :, :-1]
    if "noise_key" in batch:  # training with feature noise
        inputs = add_feature_noise(inputs, batch["noise_key"], opts["feature_noise"])
    feats = call(FeatureDrafterNet.fuse_states, inputs)
    emb = lambda ids, chain=False: call(FeatureDrafterNet.embed, frozen["embed"], ids, chain)  # noqa: E731
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    i = jnp.arange(t)
    mask = (i[None, :, None] >= i[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
    # step 1 reads verified positions: eagle's (and hsd's with root_token) carry the next token
    x = call(FeatureDrafterNet.eagle_input, feats, emb(_shift(tokens, 1))) if cfg.token_input else feats
    q, k_true, v_true = call(FeatureDrafterNet.project, x, pos)
    own_k, own_v = [], []
    attn = rollout_attention(q, k_true, v_true, mask, own_k, own_v)
    out = call(FeatureDrafterNet.finish, x, attn)
    total, metrics = 0.0, {}
    for s in range(1, opts["rollout"] + 1):
        if s == 2 and opts.get("detach_chain"):  # the chain reads the first layer's work as given data
            out, k_true, v_true = (jax.lax.stop_gradient(a) for a in (out, k_true, v_true))
        if s > 1:  # feed the previous prediction back at position t+s-1
            x = out if cfg.method == "hsd" else call(FeatureDrafterNet.eagle_input, out, emb(_shift(tokens, s)))
            q, k, v = call(FeatureDrafterNet.chain_project, x, pos + s - 1)  # hsd's chain layer, if it has one
            own_k.append(k)
            own_v.append(v)
            out = call(FeatureDrafterNet.chain_finish, x, rollout_attention(q, k_true, v_true, mask, own_k, own_v))
        ok = (_shift(doc, s, -1) == doc) & (i[None, :] + s < t)
        w = _shift(weight, s) * ok
        if cfg.method == "hsd":
            chain = s > 1  # a chain state (``chain_g``: its own g and norms)
            path = emb(jnp.stack([_shift(tokens, s), _shift(tokens, s - 1)], axis=-1)[..., : cfg.inject_tokens], chain)
            context = None
            if cfg.injection == "attn":  # g reads the true context (up to t) at the injected token's position
                query = call(FeatureDrafterNet.inject_query, out, path, pos + s, chain)
                context = rollout_attention(query, k_true, v_true, mask, [], [])
            logits = call(FeatureDrafterNet.logits, call(FeatureDrafterNet.inject, out, path, context, chain), head, chain)
        else:
            logits = call(FeatureDrafterNet.logits, out, head)
        logp = jax.nn.log_softmax(logits, axis=-1)
        top_draft = _shift(batch["top_draft"], s, -1)  # [B, T, k] draft-vocab index or -1
        top_p = jax.nn.softmax(_shift(batch["top_logits"], s).astype(jnp.float32), axis=-1)
        in_vocab = top_draft >= 0
        picked = jnp.take_along_axis(logp, jnp.maximum(top_draft, 0), axis=-1)
        ce = -jnp.sum(jnp.where(in_vocab, top_p * picked, 0.0), axis=-1)
        reg = jnp.mean(optax.huber_loss(call(FeatureDrafterNet.to_target, out), _shift(target_h, s)), axis=-1)
        denom = jnp.maximum(jnp.sum(w), 1.0)
        step_loss = jnp.sum(w * (opts["ce_weight"] * ce + opts["reg_weight"] * reg)) / denom
        total = total + opts["step_decay"] ** (s - 1) * step_loss
        correct = (jnp.argmax(logp, axis=-1) == top_draft[..., 0]) & in_vocab[..., 0]
        metrics[f"acc{s}"] = jnp.sum(correct * ok * (weight > 0.99)) / jnp.maximum(jnp.sum(ok * (weight > 0.99)), 1)
        metrics[f"acc_ce{s}"] = jnp.sum(w * ce) / denom  # "acc" prefix: reported with the accuracies
        metrics[f"acc_reg{s}"] = jnp.sum(w * reg) / denom
        metrics[f"correct{s}"] = correct & ok
        if s == 1:
            metrics["anchor"] = ok & (_shift(weight, 1) > 0.99)  # answer positions with a next token
    return total, metrics


def chain_acceptance(metrics: dict[str, Array], rollout: int) -> Array:
    """Mean accepted length of a width-1 greedy chain of ``rollout`` drafts, from per-step top-1
    correctness along the true path (+1 for the target's own token)."""
    run = jnp.ones_like(metrics["correct1"], jnp.float32)
    acc = jnp.zeros_like(run)
    for s in range(1, rollout + 1):
        run = run * metrics[f"correct{s}"]
        acc = acc + run
    valid = metrics["anchor"]
    return 1 + jnp.sum(acc * valid) / jnp.maximum(jnp.sum(valid), 1)


def document_span(doc: Int[np.ndarray, " N"], docs: Int[np.ndarray, " D"]) -> slice:
    """The positions of documents ``docs`` (consecutive ids) in the flat stream, whose ids never decrease."""
    lo, hi = int(docs.min()), int(docs.max())
    if hi - lo + 1 != len(np.unique(docs)):
        raise ValueError("documents must be a consecutive range of ids")
    return slice(int(np.searchsorted(doc, lo, "left")), int(np.searchsorted(doc, hi, "right")))


class WindowData:
    """Windows of the flat stream, as batches of numpy arrays."""

    def __init__(self, data: dict[str, np.ndarray], vocab_map: np.ndarray, window: int, prompt_weight: float,
                 docs: np.ndarray):
        keep = document_span(data["doc"], docs)  # a slice: the big arrays are views, not copies
        self.tokens = data["tokens"][keep]
        self.doc = data["doc"][keep]
        self.weight = np.where(data["answer"][keep], 1.0, prompt_weight).astype(np.float32)
        self.states = data["states"][keep]
        self.top_logits = data["top_logits"][keep]
        self.top_draft = vocab_map[data["top_ids"][keep]]
        self.window = window
        self.starts = np.arange(0, max(len(self.tokens) - window, 1), window)

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, starts: np.ndarray) -> dict[str, np.ndarray]:
        w = self.window
        idx = starts[:, None] + np.arange(w)[None, :]
        idx = np.minimum(idx, len(self.tokens) - 1)
        return {"tokens": self.tokens[idx], "doc": self.doc[idx], "weight": self.weight[idx],
                "states": self.states[idx], "top_logits": self.top_logits[idx], "top_draft": self.top_draft[idx]}


def make_optimizer(opts: dict[str, Any], total_steps: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, opts["lr"], min(opts["warmup"], max(total_steps // 10, 1)),
                                                  max(total_steps, 2), end_value=opts["lr"] * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=opts["weight_decay"]))


# ------------------------------------------------------------------------------------------ data parallel
def check_data_parallel(batch: int, mesh: Mesh | None) -> None:
    """The batch of windows must split evenly over the mesh's ``data`` axis."""
    if mesh is None:
        return
    d = int(mesh.shape["data"])
    if batch % d:
        raise HsdjaxError(f"train batch {batch} does not divide by the mesh's data axis ({d}): use a batch that "
                          f"is a multiple of {d} (train.batch in the config) or a smaller data axis "
                          "(--mesh data=D,model=M)")


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of ``mesh`` (params, optimizer state, frozen arrays, metrics)."""
    return NamedSharding(mesh, P())


def by_rows(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data``, every other axis whole."""
    return NamedSharding(mesh, P("data"))


def place_batch(batch: dict[str, Shaped[np.ndarray, "B ..."]], mesh: Mesh | None) -> dict[str, Any]:
    """A batch of windows on the mesh, rows over ``data`` (unchanged without a mesh). The NumPy
    arrays must be identical on every process of a multi-host run (they are: same seeds, same data)."""
    if mesh is None:
        return batch
    check_data_parallel(len(next(iter(batch.values()))), mesh)
    return jax.device_put(batch, by_rows(mesh))


def place_replicated(tree: Any, mesh: Mesh | None) -> Any:
    """Params / optimizer state / frozen arrays whole on every device (default device without a mesh)."""
    if mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, tree)
    return jax.device_put(tree, replicated(mesh))


def jit_step(fn: Any, mesh: Mesh | None, batch_arg: int, n_args: int) -> Any:
    """``jax.jit(fn)``; with a mesh, argument ``batch_arg`` is split by rows over ``data`` and every
    other argument and every output is replicated (so the gradient all-reduce is the compiler's)."""
    if mesh is None:
        return jax.jit(fn)
    ins = tuple(by_rows(mesh) if i == batch_arg else replicated(mesh) for i in range(n_args))
    return jax.jit(fn, in_shardings=ins, out_shardings=replicated(mesh))


def abstract_like(tree: Any) -> Any:
    """Shape, dtype and sharding of every array of ``tree`` (other leaves kept): an orbax restore
    target that places the restored arrays as ``tree``'s are placed now, whatever mesh saved them."""
    def leaf(a: Any) -> Any:
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return a

    return jax.tree_util.tree_map(leaf, tree)


def restore_checkpoint(manager: Any, step: int, template: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint ``step`` of ``manager`` restored onto the placement of ``template`` (the current
    run's freshly initialized and placed ``params`` / ``opt_state`` / ``step``)."""
    import orbax.checkpoint as ocp

    return manager.restore(step, args=ocp.args.StandardRestore(abstract_like(template)))


# ------------------------------------------------------------------------------------------ training
def train(cfg: FeatureConfig, data: dict[str, np.ndarray], frozen: dict[str, Any], vocab_ids: np.ndarray,
          opts: dict[str, Any], ckpt_dir: Path, *, progress: bool = True, log: Any = print,
          mesh: Mesh | None = None, init_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train (or resume training) a drafter; returns the final params and the evaluation history.

    ``init_params``: start from these (a trained drafter of the same shape, ``checkpoint.warm_start``)
    instead of fresh ones; the optimizer and its schedule start anew, and the history opens with the
    starting point's held-out figures (step 0), so a run shows what it added on the same windows.

    ``mesh``: train data-parallel over its ``data`` axis (see the module docstring); ``opts["batch"]``
    must divide by its size. None: one device.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    opts = {**TRAIN_DEFAULTS, **opts}
    check_data_parallel(opts["batch"], mesh)
    vocab_map = np.full((frozen["embed"].shape[0],), -1, np.int32)
    vocab_map[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)
    docs = np.unique(data["doc"])
    n_hold = max(1, int(len(docs) * opts["holdout"]))
    train_set = WindowData(data, vocab_map, opts["window"], opts["prompt_weight"], docs[:-n_hold])
    eval_set = WindowData(data, vocab_map, opts["window"], opts["prompt_weight"], docs[-n_hold:])
    steps_per_epoch = max(len(train_set) // opts["batch"], 1)
    total = max(int(steps_per_epoch * opts["epochs"]), 1)
    if opts["max_steps"]:
        total = min(total, opts["max_steps"])
    optimizer = make_optimizer(opts, total)
    frozen_j = place_replicated(dict(frozen), mesh)
    static_opts = {k: opts[k] for k in ("rollout", "step_decay", "ce_weight", "reg_weight", "feature_noise",
                                         "detach_chain")}

    def train_step(params, opt_state, batch, frozen_j):
        (loss, metrics), grads = jax.value_and_grad(rollout_loss, has_aux=True)(params, batch, frozen_j, cfg,
                                                                                static_opts)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, {k: v for k, v in metrics.items()
                                                                        if k.startswith("acc")}

    def eval_step(params, batch, frozen_j):
        loss, metrics = rollout_loss(params, batch, frozen_j, cfg, static_opts)
        return loss, chain_acceptance(metrics, opts["rollout"]), {k: v for k, v in metrics.items()
                                                                  if k.startswith("acc")}

    train_step = jit_step(train_step, mesh, batch_arg=2, n_args=4)
    eval_step = jit_step(eval_step, mesh, batch_arg=1, n_args=3)
    params = init_net(cfg, opts["seed"])
    if init_params is not None:
        params = same_shapes(params, init_params)
    params = place_replicated(params, mesh)
    opt_state = place_replicated(optimizer.init(params), mesh)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(ckpt_dir.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    step, history = 0, []
    run = {"train_windows": len(train_set), **{k: opts[k] for k in ("window", "batch", "rollout", "lr", "seed")}}
    if opts["init"]:
        run["init"] = opts["init"]
    check_same_run(ckpt_dir, run)
    if manager.latest_step() is not None:
        restored = restore_checkpoint(manager, manager.latest_step(),
                                      {"params": params, "opt_state": opt_state, "step": 0})
        params, opt_state, step = restored["params"], restored["opt_state"], int(restored["step"])
        hist_path = ckpt_dir / "history.json"
        history = json.loads(hist_path.read_text()) if hist_path.exists() else []
        log(f"resumed from step {step} of {total}")

    def save(at: int) -> None:
        manager.save(at, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state, "step": at}))
        manager.wait_until_finished()
        if jax.process_index() == 0:  # multi-host: one writer
            (ckpt_dir / "history.json").write_text(json.dumps(history, indent=1))

    def evaluate() -> dict[str, float]:
        n = max(min(len(eval_set) // opts["batch"], 8), 1)
        rows = []
        for j in range(n):
            starts = eval_set.starts[j * opts["batch"]:(j + 1) * opts["batch"]]
            if len(starts) < opts["batch"]:
                starts = np.resize(eval_set.starts, opts["batch"])
            loss, acc_len, m = eval_step(params, place_batch(eval_set.batch(starts), mesh), frozen_j)
            rows.append({"loss": float(loss), "chain_accept": float(acc_len), **{k: float(v) for k, v in m.items()}})
        return {k: round(float(np.mean([r[k] for r in rows])), 4) for k in rows[0]}

    if init_params is not None and step == 0 and not history:  # the starting point, on the same held-out windows
        history.append({"step": 0, "epoch": 0.0, **evaluate()})
        log(f"step 0 (the starting checkpoint): held-out {history[0]}")
    rng = np.random.default_rng(opts["seed"])
    bar = tqdm(total=total, initial=step, unit="step", desc=f"train {cfg.method}", disable=not progress)
    last_save = time.monotonic()
    t0 = time.perf_counter()
    tokens_per_step = opts["batch"] * opts["window"]
    lap_t, lap_step = t0, step  # throughput since the last evaluation (compilation included in the first)
    saved = step
    restore_sigterm = sigterm_as_interrupt()
    try:
        while step < total:
            epoch = step // steps_per_epoch
            order = np.random.default_rng(opts["seed"] + epoch).permutation(len(train_set))
            j = step % steps_per_epoch
            starts = train_set.starts[order[j * opts["batch"]:(j + 1) * opts["batch"]]]
            if len(starts) < opts["batch"]:
                starts = rng.choice(train_set.starts, opts["batch"])
            batch = train_set.batch(starts)
            if opts["feature_noise"] > 0:  # per-row keys from (seed, step): a resumed run draws the same noise
                batch["noise_key"] = np.asarray(jax.random.split(
                    jax.random.fold_in(jax.random.PRNGKey(opts["seed"]), step), opts["batch"]))
            # one assignment: an interrupt cannot fall between the new params and their step count
            params, opt_state, loss, m, step = (*train_step(params, opt_state, place_batch(batch, mesh), frozen_j),
                                                step + 1)
            bar.update(1)
            if step % 10 == 0:
                rate = (step - lap_step) * tokens_per_step / max(time.perf_counter() - lap_t, 1e-9)
                bar.set_postfix(loss=f"{float(loss):.3f}", acc1=f"{float(m['acc1']):.3f}", tok_s=f"{rate:.0f}")
            end_of_epoch = step % steps_per_epoch == 0 or step == total
            if end_of_epoch:
                now = time.perf_counter()
                rate = (step - lap_step) * tokens_per_step / max(now - lap_t, 1e-9)
                ev = evaluate()
                history.append({"step": step, "epoch": step / steps_per_epoch, "train_loss": round(float(loss), 4),
                                "seconds": round(now - t0, 1), "train_tokens_per_s": round(rate, 1), **ev})
                lap_t, lap_step = time.perf_counter(), step
                log(f"step {step}: held-out {ev}")
            if end_of_epoch or time.monotonic() - last_save > opts["save_every_s"]:
                save(step)
                last_save, saved = time.monotonic(), step
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the steps done since the last save, then stop
        if step > saved:
            log(f"interrupted: saving step {step} (run the same command to resume)")
            save(step)
        raise
    finally:
        restore_sigterm()
    bar.close()
    if not history:
        history.append({"step": step, **evaluate()})
    return {"params": params, "history": history, "steps": step, "train_windows": len(train_set),
            "eval_windows": len(eval_set)}


def sigterm_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM (``kill``, a job manager or a session ending the process) raise KeyboardInterrupt, so
    training saves its steps as on Ctrl-C (a job started with ``&`` ignores SIGINT); returns the function
    that puts the previous handler back. Only the main thread can set handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


def same_shapes(fresh: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` as float32 arrays, checked to have ``fresh``'s entries and shapes (a warm start)."""
    want = {k: v.shape for k, v in flatten(fresh).items()}
    got = {k: np.shape(v) for k, v in flatten(given).items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise HsdjaxError(f"the starting drafter's parameters do not fit this drafter (e.g. {diff})")
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), given)


def check_same_run(ckpt_dir: Path, run: dict[str, Any]) -> None:
    """Record what a run trains on; refuse to resume a run whose data or schedule has changed since
    (more data or other settings would silently continue an old schedule)."""
    path = ckpt_dir / "run.json"
    if path.exists():
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in run.items() if before.get(k) != v}
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise HsdjaxError(f"{ckpt_dir} holds a training run with other data or settings ({what}); move it "
                              "away to keep it, or give the config another name, then run again")
    elif jax.process_index() == 0:
        path.write_text(json.dumps(run, indent=1))


def check_data(data: dict[str, np.ndarray], need_layers: int) -> None:
    if data["states"].shape[1] != need_layers:
        raise HsdjaxError(f"drafter data has {data['states'].shape[1]} recorded layers, expected {need_layers}")
