"""The model runtime: cached vs uncached forward, tree masks, cache commit, and transformers parity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hsdjax.runtime.model import Transformer, causal_mask, commit, init_cache


def forward(cfg, params, tokens, positions, mask, cache=None):
    model = Transformer(cfg)
    out = model.apply({"params": params}, tokens, positions, mask, cache)
    return out, model.apply({"params": params}, out["hidden"], method=Transformer.logits)


def full_logits(cfg, params, seq):
    t = len(seq)
    tokens = jnp.array([seq], jnp.int32)
    _, logits = forward(cfg, params, tokens, jnp.arange(t)[None], causal_mask(jnp.array([t]), t))
    return np.asarray(logits[0])


def test_incremental_equals_full(tiny):
    """Prefill a prefix, commit, then feed the rest one token at a time: logits equal the full pass."""
    cfg, params = tiny
    seq = list(np.random.RandomState(0).randint(0, cfg.vocab_size, 12))
    ref = full_logits(cfg, params, seq)
    p = 5
    out, logits = forward(cfg, params, jnp.array([seq[:p]]), jnp.arange(p)[None], causal_mask(jnp.array([p]), p))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[:p], atol=1e-5)
    cache = commit(init_cache(cfg, 1, 32), out["k"], out["v"], jnp.arange(p)[None], jnp.array([p]))
    for i in range(p, len(seq)):
        out, logits = forward(cfg, params, jnp.array([[seq[i]]]), jnp.array([[i]]), jnp.ones((1, 1, 1), bool), cache)
        np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[i], atol=1e-5)
        cache = commit(cache, out["k"], out["v"], jnp.zeros((1, 1), jnp.int32), jnp.array([1]))
    assert int(cache.length[0]) == len(seq)


def test_tree_mask_matches_paths(tiny):
    """A branched tree verified in one call gives each node the logits of its own root path."""
    cfg, params = tiny
    rng = np.random.RandomState(1)
    prefix = list(rng.randint(0, cfg.vocab_size, 6))
    # tree: 0 -> 1 -> 3 ; 0 -> 2 -> 4 -> 5 ; node tokens random
    parents = [-1, 0, 0, 1, 2, 4]
    toks = list(rng.randint(0, cfg.vocab_size, len(parents)))
    depth = [0] * len(parents)
    anc = np.eye(len(parents), dtype=bool)
    for i, par in enumerate(parents):
        if par >= 0:
            depth[i] = depth[par] + 1
            anc[i] |= anc[par]
    out, _ = forward(cfg, params, jnp.array([prefix]), jnp.arange(6)[None], causal_mask(jnp.array([6]), 6))
    cache = commit(init_cache(cfg, 1, 32), out["k"], out["v"], jnp.arange(6)[None], jnp.array([6]))
    positions = jnp.array([[6 + d for d in depth]])
    _, logits = forward(cfg, params, jnp.array([toks]), positions, jnp.array([anc]), cache)
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.append(toks[node])
            node = parents[node]
        ref = full_logits(cfg, params, prefix + path[::-1])
        np.testing.assert_allclose(np.asarray(logits[0, i]), ref[-1], atol=1e-5)


def test_commit_packs_accepted_entries(tiny):
    cfg, _ = tiny
    cache = init_cache(cfg, 2, 16)
    cache = cache.replace(length=jnp.array([3, 5]))
    shape = (cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    new_k = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    keep = jnp.array([[0, 2, 3], [1, 0, 0]])
    out = commit(cache, new_k, new_k, keep, jnp.array([3, 1]))
    assert out.length.tolist() == [6, 6]
    for row, idx in ((0, [0, 2, 3]), (1, [1])):
        start = int(cache.length[row])
        got = np.asarray(out.k[:, row, :, start:start + len(idx)])
        want = np.asarray(new_k[:, row, idx]).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(got, want)


def test_batch_rows_are_independent(tiny):
    """Rows with different prompt lengths in one batch give the same logits as alone."""
    cfg, params = tiny
    rng = np.random.RandomState(2)
    a, b = list(rng.randint(0, cfg.vocab_size, 7)), list(rng.randint(0, cfg.vocab_size, 4))
    tokens = jnp.array([a, b + [0, 0, 0]])
    _, logits = forward(cfg, params, tokens, jnp.broadcast_to(jnp.arange(7), (2, 7)), causal_mask(jnp.array([7, 4]), 7))
    np.testing.assert_allclose(np.asarray(logits[0]), full_logits(cfg, params, a), atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1, :4]), full_logits(cfg, params, b), atol=1e-5)


def _to_hf_state_dict(cfg, params):
    """Canonical params -> transformers state dict (torch layout), for the parity test."""
    import torch

    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"])}
    names = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
             "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight"}
    for name, stacked in params["layers"].items():
        for i in range(cfg.num_layers):
            w = np.asarray(stacked[i])
            sd[f"model.layers.{i}.{names[name]}"] = t(w.T if w.ndim == 2 else w)
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t(np.asarray(params["lm_head"]).T)
    return sd


def _hf_config(cfg):
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_context,
                  tie_word_embeddings=cfg.tie_embeddings)
    if cfg.family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


def test_hf_folder_roundtrip_matches_transformers(tiny, tmp_path, monkeypatch):
    """Save a tiny model as a HF folder with transformers, load it through hsdjax, compare logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HSDJAX_HOME", str(tmp_path / "home"))
    cfg, params = tiny
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg)).eval()
    hf.load_state_dict(_to_hf_state_dict(cfg, params), strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    hf.save_pretrained(tmp_path / "model")
    from hsdjax.runtime.weights import convert_hf

    loaded_cfg, loaded = convert_hf(tmp_path / "model")
    assert loaded_cfg.replace(max_context=cfg.max_context) == cfg
    seq = list(np.random.RandomState(3).randint(0, cfg.vocab_size, 16))
    ours = full_logits(cfg, loaded, seq)
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def load_transformers_reference(model):
    """transformers' PyTorch model read from the same GGUF file (its own dequantizer), float32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = model.source.path
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def assert_matches_transformers(model, hf, logits_prompt: str, greedy_prompt: str, tolerance: float) -> None:
    """Logits over a 64-token chat prompt agree within ``tolerance``; 64 greedy tokens are identical."""
    import torch

    from hsdjax.frontends.api import Generator

    tok = model.tokenizer
    ids = (tok.encode_chat([{"role": "user", "content": logits_prompt}]) * 4)[:64]
    assert len(ids) == 64
    ours = full_logits(model.cfg, model.params, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(ours - ref).max())
    print(f"{model.name} max |logit diff| over 64 tokens: {diff:.2e}")
    assert diff < tolerance
    prompt = tok.encode_chat([{"role": "user", "content": greedy_prompt}])
    result = Generator(model).generate(prompt, max_new_tokens=64)[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          eos_token_id=list(tok.stop_ids), pad_token_id=tok.stop_ids[0])
    assert result.tokens == out[0, len(prompt):].tolist()


def test_smollm2_logits_and_greedy_match_transformers(smollm):
    """Our SmolLM2 (from the same GGUF) matches transformers' PyTorch model: logits on a 64-token
    prompt, and 64 greedy tokens."""
    assert_matches_transformers(
        smollm, load_transformers_reference(smollm),
        "Write a short poem about the sea and the wind, then explain what a metaphor is in two sentences.",
        "What is the capital of France? Answer briefly.", tolerance=2e-3)


@pytest.mark.slow
def test_qwen_coder_05b_matches_transformers():
    """Qwen2 family on real weights (q/k/v bias, untied head): logits on a 64-token prompt and 64
    greedy tokens equal transformers' on the same GGUF. Needs `hsdjax models pull qwen2.5-coder-0.5b`."""
    from hsdjax.frontends.api import load_model
    from hsdjax.runtime import registry

    if not registry.is_installed("qwen2.5-coder-0.5b"):
        pytest.skip("qwen2.5-coder-0.5b is not installed (hsdjax models pull qwen2.5-coder-0.5b)")
    model = load_model("qwen2.5-coder-0.5b")
    assert_matches_transformers(
        model, load_transformers_reference(model),
        "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
        "Write a haiku about recursion.", tolerance=5e-3)


@pytest.mark.parametrize("scan", [True, False])
def test_fused_projections_equal_separate(tiny, scan):
    """q/k/v and gate/up fused into one matmul each (what load_model does unsharded) give the same
    outputs and cache entries as the separate weights, stacked or unrolled, with and without qkv bias."""
    from hsdjax.runtime.model import fuse_projections, unstack_layers

    cfg, params = tiny
    if not scan:
        params = unstack_layers(params)
    cfg = cfg.replace(scan_layers=scan)
    fused_cfg = cfg.replace(fused_projections=True)
    fused = fuse_projections(params)
    layer = fused["layers"] if scan else fused["blocks_0"]
    assert "wqkv" in layer and "wq" not in layer and ("bqkv" in layer) == cfg.qkv_bias
    tokens = jnp.array(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    mask = causal_mask(jnp.array([7, 5]), 7)
    want = Transformer(cfg).apply({"params": params}, tokens, pos, mask)
    got = Transformer(fused_cfg).apply({"params": fused}, tokens, pos, mask)
    for key in ("hidden", "k", "v"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5, atol=2e-5)


def test_target_parts_load_only_the_head_and_equal_the_full_weights(smollm):
    """A drafter's training loads the embeddings, head and final norm without the layers; they are the
    full load's arrays, and the provenance a checkpoint is bound to is the same."""
    from hsdjax.runtime.loading import load_target_parts
    from hsdjax.runtime.weights import load_weights

    parts = load_target_parts("smollm2-135m")
    _, full, _ = load_weights(smollm.source.path, smollm.source.kind, smollm.fingerprint)
    assert set(parts.params) == {"embed", "final_norm"} | ({"lm_head"} if "lm_head" in full else set())
    for key, value in parts.params.items():
        np.testing.assert_array_equal(value, full[key])
    assert parts.fingerprint == smollm.fingerprint and parts.name == smollm.name
    assert parts.cfg.replace(dtype=smollm.cfg.dtype) == smollm.cfg.replace(
        scan_layers=parts.cfg.scan_layers, backend=parts.cfg.backend, cache_dtype=parts.cfg.cache_dtype,
        fused_projections=parts.cfg.fused_projections, screened_head=parts.cfg.screened_head,
        cpu_matmul_prefill_xla=parts.cfg.cpu_matmul_prefill_xla)  # load-time settings
