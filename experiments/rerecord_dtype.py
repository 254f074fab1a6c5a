"""Re-recording drafter data in bfloat16: how much faster, how far from float32?

Teacher-forced passes (``train.datagen.teacher_forced``, 4-row groups) over one piece of the committed
Qwen2.5-Coder-1.5B answers, three ways: the CPU kernels' float32 products (the default), the same
model with its projections decoded once to bfloat16 and multiplied by XLA's dot with float32 sums
(``data.rerecord_dtype="bfloat16"``, ``datagen.rerecording_target``), and the whole model loaded in
bfloat16 on XLA's dot (``load_model(dtype="bfloat16", cpu_matmul="off")``). Prints each one's tokens/s
after compiling, and the bfloat16 kernel variant's distance to the float32 states and top ids.

    python experiments/rerecord_dtype.py --piece 3
"""

from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

import hsdjax
from hsdjax.kernels.cpu_matmul import cpu_summary
from hsdjax.train import datagen
from hsdjax.train.answers import AnswerStore

FOLDER = "data/answers/qwen2.5-coder-1.5b"


def timed(model, docs):
    drafter, dparams = datagen.recording_drafter(model, 8)
    t0 = time.perf_counter()
    recs, compile_s = datagen.teacher_forced(model, drafter, dparams, docs, 4)
    return recs, time.perf_counter() - t0 - compile_s, compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--piece", type=int, default=3)
    ap.add_argument("--skip-xla", action="store_true", help="leave out the whole-model bfloat16 XLA load")
    args = ap.parse_args()
    man = json.load(open(f"{FOLDER}/manifest.json"))
    store = AnswerStore(FOLDER, {k: man[k] for k in ("target_fingerprint", "tokenizer", "data_key")})
    docs = [d["tokens"] for d in store.read(store.pieces[args.piece])]
    n = sum(len(d) for d in docs)
    print(f"CPU {cpu_summary()}; piece {args.piece}: {len(docs)} documents, {n} tokens")
    model = hsdjax.load_model("qwen2.5-coder-1.5b")
    runs = {"float32 (kernel)": model, "bfloat16 dots (rerecord_dtype)": datagen.rerecording_target(model, "bfloat16")}
    recs = {}
    for name, target in runs.items():
        recs[name], run_s, compile_s = timed(target, docs)
        print(f"{name}: {n / run_s:.1f} tok/s after compiling ({run_s:.1f} s, compile {compile_s:.1f} s)", flush=True)
    if not args.skip_xla:
        del runs
        xla = hsdjax.load_model("qwen2.5-coder-1.5b", dtype="bfloat16", cpu_matmul="off")
        _, run_s, compile_s = timed(xla, docs)
        print(f"whole model bfloat16 on XLA's dot: {n / run_s:.1f} tok/s after compiling ({run_s:.1f} s)", flush=True)
    a, b = (np.concatenate([r["states"] for r in recs[k]]).view(ml_dtypes.bfloat16).astype(np.float32)
            for k in ("float32 (kernel)", "bfloat16 dots (rerecord_dtype)"))
    rel = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-6)
    ids_a, ids_b = (np.concatenate([r["top_ids"] for r in recs[k]])
                    for k in ("float32 (kernel)", "bfloat16 dots (rerecord_dtype)"))
    print("states' relative error per recorded layer: median", np.round(np.median(rel, 0), 4),
          "p99", np.round(np.percentile(rel, 99, 0), 4))
    print(f"top-1 ids equal: {np.mean(ids_a[:, 0] == ids_b[:, 0]):.4f}; top-8 sets overlap: "
          f"{np.mean([len(set(x) & set(y)) / 8 for x, y in zip(ids_a, ids_b)]):.4f}")


if __name__ == "__main__":
    main()
