#!/usr/bin/env bash
# The first-accelerator check (issue 12, item 8): one script, under 8 minutes, no network needed.
#
#   benchmarks/accelerator_check.sh [OUTDIR] [--quick]       (default OUTDIR: accelerator_check_out)
#
# On a GPU or TPU machine (also runs on CPU; --quick keeps a CPU run to a few minutes) it writes
# OUTDIR/accelerator_check.json with:
#   env          jax backend / devices, torch and transformers versions, whether the model files exist
#   kernel       the Pallas tree-attention kernel COMPILED (interpret=False) against
#                tree_attention_reference on random inputs (f32 and bf16, chain/tree masks, several
#                GQA layouts, cache lengths around block edges); on CPU, where Pallas cannot compile,
#                the same checks in interpret mode, with a note
#   round_cost   benchmarks/round_cost.py --json (random weights of SmolLM2's shapes when
#                `hsdjax models` says the model is not installed: speeds only)
#   speeds       ar / pld / hsd decode tokens/s through the engine (round_cost.py --parts speeds)
#   transformers transformers LlamaForCausalLM in bfloat16 on the same machine (cuda when torch sees
#                one), greedy, the same prompt length and number of new tokens; the real weights
#                (from the GGUF) when installed, else random weights of SmolLM2's config;
#                skipped with a note when torch / transformers are missing
# Each step has its own time limit, all within BUDGET_S (465 s); a step that fails or times out is
# recorded with its exit code and the tail of its log (OUTDIR/*.log) instead of stopping the script.
# Environment: PYTHON (default: .venv/bin/python if present, else python3), MODEL (smollm2-135m).
set -uo pipefail

OUT=accelerator_check_out
QUICK=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    -h|--help) sed -n 2,25p "$0"; exit 0 ;;
    *) OUT="$a" ;;
  esac
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODEL="${MODEL:-smollm2-135m}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
log() { echo "[accelerator_check $(( $(date +%s) - START ))s] $*" >&2; }

# step NAME SECONDS CMD...: run with a time limit (its own, cut to what is left of BUDGET_S), log to
# OUT/NAME.log, note the exit code (124: timed out; 125: skipped, no time left)
BUDGET_S="${BUDGET_S:-465}"
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) - 5 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    log "$name: skipped (no time left)"; echo 125 >"$OUT/$name.rc"; return
  fi
  log "$name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$OUT/$name.rc"
  log "$name: exit $rc"
}

# ------------------------------------------------------------------------------------------ env
step env 45 "$PYTHON" - "$OUT/env.json" "$MODEL" <<'EOF'
import json, os, platform, sys
out, model = sys.argv[1], sys.argv[2]
import jax
env = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
       "devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind,
       "cores": os.cpu_count(), "model": model}
try:
    from hsdjax.runtime import registry
    env["model_installed"] = bool(registry.is_installed(model))
except Exception as e:  # noqa: BLE001
    env["model_installed"] = False
    env["model_check_error"] = str(e)
for lib in ("torch", "transformers"):
    try:
        m = __import__(lib)
        env[lib] = m.__version__
    except Exception as e:  # noqa: BLE001
        env[lib] = None
        env[lib + "_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
if env.get("torch"):
    import torch
    env["torch_cuda"] = bool(torch.cuda.is_available())
json.dump(env, open(out, "w"), indent=1)
print(json.dumps(env))
EOF
INSTALLED=$("$PYTHON" -c "import json,sys; print(int(json.load(open(sys.argv[1])).get('model_installed', False)))" "$OUT/env.json" 2>/dev/null || echo 0)
RANDOM_FLAG=""
[ "$INSTALLED" = "1" ] || RANDOM_FLAG="--random-weights"
log "model $MODEL installed: $INSTALLED ${RANDOM_FLAG:+(using random weights: speeds only)}"

# ------------------------------------------------------------------------------------------ kernel
step kernel 75 "$PYTHON" - "$OUT/kernel.json" "$QUICK" <<'EOF'
"""The Pallas tree-attention kernel compiled (interpret=False) vs the jnp reference."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from hsdjax.kernels.tree_attention import tree_attention, tree_attention_reference

out, quick = sys.argv[1], sys.argv[2] == "1"
backend = jax.default_backend()
compiled = backend in ("gpu", "cuda", "rocm", "tpu")
note = None if compiled else f"{backend}: Pallas kernels cannot be compiled here; ran in interpret mode"
TOL = {"float32": 2e-5, "bfloat16": 2e-2}

def mask_of(parents):
    t = len(parents)
    m = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m

def inputs(seed, b, t, k, g, s, d, dtype, shape):
    rng = np.random.default_rng(seed)
    n = lambda *sh: jnp.asarray(rng.standard_normal(sh, dtype=np.float32), dtype)
    q, ck, cv, nk, nv = n(b, t, k * g, d), n(b, k, s, d), n(b, k, s, d), n(b, t, k, d), n(b, t, k, d)
    lens = [0, s, 1, s - 1, 127, 129, *rng.integers(0, s + 1, size=b).tolist()][:b]
    if shape == "chain":
        parents = [list(range(-1, t - 1))] * b
    else:
        parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, t)] for _ in range(b)]
    mask = jnp.asarray(np.stack([mask_of(p) for p in parents]))
    return q, ck, cv, jnp.asarray(np.clip(lens, 0, s), jnp.int32), nk, nv, mask

# (K, G, T, D, S): SmolLM2-like (3 kv heads x 3, D 64), Qwen-like (2 x 6, D 128), odd T, long caches
layouts = [(3, 3, 1, 64, 1024), (3, 3, 6, 64, 1024), (3, 3, 16, 64, 4096), (2, 6, 13, 128, 2048),
           (1, 1, 5, 64, 256), (2, 3, 8, 128, 512)]
masks = ("tree", "chain")
if not compiled:  # interpret mode is slow: a few small cases
    layouts, masks = ([(3, 3, 6, 64, 256)], ("tree",)) if quick else (layouts[:2], masks)
results, ok = [], True
def save(done):
    res = {"backend": backend, "compiled": compiled, "note": note, "all_ok": bool(ok) and done, "finished": done,
           "cases": results}
    json.dump(res, open(out, "w"), indent=1)
for i, (k, g, t, d, s) in enumerate(layouts):
    for dtype in ("float32", "bfloat16"):
        for shape in masks:
            args = inputs(i, 4, t, k, g, s, d, jnp.dtype(dtype), shape)
            t0 = time.perf_counter()
            try:
                got = jax.jit(lambda *a: tree_attention(*a, interpret=not compiled))(*args)
                got = np.asarray(got, np.float32)
                err = None
            except Exception as e:  # noqa: BLE001
                got, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            dt = time.perf_counter() - t0
            ref = np.asarray(tree_attention_reference(*args), np.float32)
            diff = None if got is None else float(np.max(np.abs(got - ref)))
            good = diff is not None and diff <= TOL[dtype] * max(1.0, float(np.max(np.abs(ref))))
            ok &= good
            results.append({"k": k, "g": g, "t": t, "d": d, "s": s, "dtype": dtype, "mask": shape,
                            "max_abs_diff": diff, "ok": good, "error": err, "seconds": round(dt, 3)})
            print(results[-1], flush=True)
            save(False)  # what is done survives a timeout
save(True)
sys.exit(0 if ok else 1)
EOF

# ------------------------------------------------------------------------------------------ round cost
if [ "$QUICK" = "1" ]; then
  # scan layers compile in seconds instead of ~15 s each on CPU (a smoke run, not the CPU figures)
  RC_ARGS=(--parts ar,tree,hsd --buckets 1024 --sizes 8 --rounds 8 --repeats 2 --layer-loop scan)
  SP_ARGS=(--max-new 16 --repeats 1 --layer-loop scan)
  HF_NEW=16; HF_REPEATS=1
else
  RC_ARGS=(--parts ar,tree,long,hsd,eagle --rounds 32 --repeats 3)
  SP_ARGS=(--max-new 128 --repeats 3)
  HF_NEW=128; HF_REPEATS=3
fi
step round_cost 200 "$PYTHON" benchmarks/round_cost.py --model "$MODEL" $RANDOM_FLAG --json \
  --json-out "$OUT/round_cost.json" "${RC_ARGS[@]}"
step speeds 100 "$PYTHON" benchmarks/round_cost.py --model "$MODEL" $RANDOM_FLAG --json \
  --json-out "$OUT/speeds.json" --parts speeds --speed-methods ar,pld,hsd --context 200 "${SP_ARGS[@]}"

# ------------------------------------------------------------------------------------------ transformers
step transformers 120 "$PYTHON" - "$OUT/transformers.json" "$MODEL" "$INSTALLED" "$HF_NEW" "$HF_REPEATS" <<'EOF'
"""transformers bfloat16 greedy decoding on this machine: a 200-token prompt, N new tokens."""
import json, statistics, sys, time
out, model_name, installed, new, repeats = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
try:
    import torch
    import transformers
except Exception as e:  # noqa: BLE001
    json.dump({"skipped": f"torch / transformers not importable: {e}"}, open(out, "w"))
    sys.exit(0)
import importlib.util
spec = importlib.util.spec_from_file_location("round_cost", "benchmarks/round_cost.py")
round_cost = sys.modules["round_cost"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
spec.loader.exec_module(round_cost)
KNOWN_CONFIGS = round_cost.KNOWN_CONFIGS
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
if installed:
    from hsdjax.runtime import registry
    from transformers import AutoModelForCausalLM
    src = registry.resolve(model_name, check=False)
    kw = {"gguf_file": src.path.name} if src.kind == "gguf" else {}
    folder = src.path.parent if src.kind == "gguf" else src.path
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw).to(dtype)
    weights = "real"
else:
    c = KNOWN_CONFIGS[model_name]
    if c["family"] == "llama":
        from transformers import LlamaConfig as Cfg, LlamaForCausalLM as Model
    else:
        from transformers import Qwen2Config as Cfg, Qwen2ForCausalLM as Model
    cfg = Cfg(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
              num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
              num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"], rope_theta=c["rope_theta"],
              rms_norm_eps=c["rms_norm_eps"], max_position_embeddings=c["max_context"],
              tie_word_embeddings=c["tie_embeddings"])
    torch.manual_seed(0)
    model = Model(cfg)
    weights = "random"
model = model.to(device=device, dtype=dtype).eval()
ids = torch.randint(1, model.config.vocab_size - 1, (1, 200), generator=torch.Generator().manual_seed(0)).to(device)
def run():
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        o = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return o.shape[1] - ids.shape[1], time.perf_counter() - t0
def prefill():
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0
run()  # warm-up
times, pre = [], []
for _ in range(repeats):
    n, dt = run()
    p = prefill()
    times.append((n - 1) / max(dt - p, 1e-9))
    pre.append(p)
res = {"engine": "transformers", "dtype": "bfloat16", "device": device, "weights": weights, "torch": torch.__version__,
       "transformers": transformers.__version__, "prompt_tokens": 200, "new_tokens": new,
       "decode_tokens_per_s": statistics.median(times), "prefill_s": statistics.median(pre),
       "note": "decode tok/s = (new - 1) / (generate seconds - a separate prefill's seconds)"}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res))
EOF

# ------------------------------------------------------------------------------------------ summary
"$PYTHON" - "$OUT" "$QUICK" "$START" <<'EOF'
import json, os, sys, time
out, quick, start = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
def part(name):
    path = os.path.join(out, f"{name}.json")
    rc_path = os.path.join(out, f"{name}.rc")
    rc = int(open(rc_path).read().strip()) if os.path.exists(rc_path) else None
    data = None
    if os.path.exists(path):
        try:
            data = json.load(open(path))
        except ValueError:
            data = None
    if rc not in (0, None) or data is None:
        log = os.path.join(out, f"{name}.log")
        tail = open(log).read()[-2000:] if os.path.exists(log) else ""
        return {"exit_code": rc, "timed_out": rc in (124, 137), "result": data, "log_tail": tail}
    return data
result = {name: part(name) for name in ("env", "kernel", "round_cost", "speeds", "transformers")}
result["quick"] = quick
result["seconds"] = int(time.time()) - start
notes = []
env = result["env"] if isinstance(result["env"], dict) else {}
if not env.get("model_installed", False):
    notes.append("model files absent: random weights of the model's shapes; speeds only (accept lengths meaningless)")
sp, hf = result.get("speeds"), result.get("transformers")
if isinstance(sp, dict) and isinstance(sp.get("speeds"), dict) and isinstance(hf, dict) and hf.get("decode_tokens_per_s"):
    result["vs_transformers_bf16"] = {m: s["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
                                     for m, s in sp["speeds"].items() if s.get("decode_tokens_per_s")}
elif isinstance(hf, dict) and hf.get("skipped"):
    notes.append(hf["skipped"])
for name in ("env", "kernel", "round_cost", "speeds", "transformers"):
    r = result[name]
    if isinstance(r, dict) and "exit_code" in r:
        why = {124: "timed out", 137: "timed out", 125: "skipped: no time left"}.get(r["exit_code"], "failed")
        notes.append(f"{name}: {why} (exit {r['exit_code']}); see {name}.log")
result["notes"] = notes
path = os.path.join(out, "accelerator_check.json")
json.dump(result, open(path, "w"), indent=1)
print(f"wrote {path}")
print(json.dumps({k: result[k] for k in ("quick", "seconds", "notes")} | {"vs_transformers_bf16": result.get("vs_transformers_bf16")}))
EOF
