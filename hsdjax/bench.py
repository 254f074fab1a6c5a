"""``hsdjax bench``: the Spec-Bench-compatible benchmark harness.

Reads Spec-Bench question files, runs every method (and the external peers) on every question,
turn by turn with the model's chat template (a method's own answer to turn 1 is part of its turn-2
prompt), and writes:

* ``OUT/answers/<method>.jsonl`` -- Spec-Bench answer files (one line per question, sorted by
  ``question_id``, no duplicates after a resume), readable by Spec-Bench's ``speed.py`` / ``equal.py``;
  ``wall_time`` per turn is prefill + decode seconds, compilation excluded;
* ``OUT/raw/<method>.jsonl`` -- token ids and engine counters per turn (what resume and the report use);
* ``OUT/report.md``, ``OUT/report.json`` and PNG plots (speed-up per category, accepted-length histogram,
  per-depth acceptance).

Arithmetic as in Spec-Bench: a question's speed is its new tokens over its wall time (all turns); a
method's speed is the mean over questions; speed-up is the ratio of those means against ``ar``.
Methods are compiled before timing and interleaved question by question in a rotating order, so
machine drift hits every method alike. A killed run continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from hsdjax.api import Generator, load_model
from hsdjax.errors import HsdjaxError
from hsdjax.jsonl import read_objects
from hsdjax.methods import FEATURE_METHODS, METHODS, draft_model_of, has_shipped_drafter, options_for
from hsdjax.peers import PEERS, peer_available, start_peers


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]


def read_questions(path: str | Path) -> list[Question]:
    """Parse a Spec-Bench question file; a bad line is reported with its number."""
    path = Path(path)
    out, seen = [], set()
    for n, item in read_objects(path, "question file"):
        qid, cat, turns = item.get("question_id"), item.get("category", "default"), item.get("turns")
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise HsdjaxError(f"{path}:{n}: 'question_id' must be an integer")
        if not isinstance(cat, str):
            raise HsdjaxError(f"{path}:{n}: 'category' must be a string")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise HsdjaxError(f"{path}:{n}: 'turns' must be a non-empty list of non-empty strings")
        if qid in seen:
            raise HsdjaxError(f"{path}:{n}: duplicate question_id {qid}")
        seen.add(qid)
        out.append(Question(qid, cat, tuple(turns)))
    if not out:
        raise HsdjaxError(f"{path}: no questions")
    return out


def select_questions(files: Sequence[str | Path], limit: int | None = None,
                     per_category: int | None = None) -> tuple[list[Question], list[str]]:
    """The questions to run, in file order: the first ``per_category`` of each category, then the first
    ``limit``, of each file. Spec-Bench answer files need one id per question, so a file whose ids collide
    with an earlier file's is renumbered by a multiple of 1000 (said in the returned notes)."""
    out: list[Question] = []
    notes: list[str] = []
    seen: set[int] = set()
    for f in files:
        qs = read_questions(f)
        ids = {q.question_id for q in qs}  # offsets come from whole files, so a selection cannot change them
        offset = (max(seen) // 1000 + 1) * 1000 if seen & ids else 0
        if offset:
            qs = [Question(q.question_id + offset, q.category, q.turns) for q in qs]
            notes.append(f"{Path(f).name}: question ids + {offset} (they collide with an earlier file's)")
        seen |= {i + offset for i in ids}
        if per_category is not None:
            counts: dict[str, int] = {}
            keep = []
            for q in qs:
                counts[q.category] = counts.get(q.category, 0) + 1
                if counts[q.category] <= per_category:
                    keep.append(q)
            qs = keep
        out += qs[:limit]
    return out, notes


@dataclass
class Turn:
    text: str
    tokens: list[int]
    wall_time: float  # prefill + decode seconds
    accept_lengths: list[int]
    target_passes: int = 0
    draft_steps: int = 0
    drafter_states: int = 0
    accepted_drafts: int = 0
    drafter_macs: float = 0.0


class LocalMethod:
    """One hsdjax method on the loaded model."""

    external = False

    def __init__(self, gen: Any):
        self.gen, self.name = gen, gen.method

    def settings(self) -> dict[str, Any]:
        """The drafter's effective options (tuned defaults included): what a resume must match."""
        d = self.gen.drafter
        fields = vars(d) if hasattr(d, "__dict__") else {}
        return {k: v for k, v in sorted(fields.items()) if isinstance(v, (bool, int, float, str, type(None)))}

    def turn(self, messages: list[dict[str, str]], max_new: int, temperature: float, seed: int) -> Turn:
        r = self.gen.generate(messages, max_new_tokens=max_new, temperature=temperature, seed=seed)[0]
        return Turn(r.text, r.tokens, r.seconds, r.stats["accept_lengths"], r.stats["target_passes"],
                    r.stats["draft_steps"], r.stats.get("drafter_states", 0), r.stats.get("accepted_drafts", 0),
                    r.stats.get("drafter_macs", 0.0))


class PeerMethod:
    """An external engine (``hsdjax.peers``) fed the same token ids."""

    external = True

    def __init__(self, peer: Any, tokenizer: Any):
        self.peer, self.name, self.tokenizer = peer, peer.name, tokenizer

    def settings(self) -> dict[str, Any]:
        return {"dtype": self.peer.dtype}

    def turn(self, messages: list[dict[str, str]], max_new: int, temperature: float, seed: int) -> Turn:
        ids = self.tokenizer.encode_chat(messages)
        a = self.peer.generate(ids, max_new)
        toks = a["tokens"]
        stops = set(self.tokenizer.stop_ids)
        text = self.tokenizer.decode([t for t in toks if t not in stops], skip_special_tokens=True)
        return Turn(text, toks, a["total_s"], [])


def answer_question(method: Any, q: Question, max_new: int, temperature: float, seed: int) -> list[Turn]:
    messages: list[dict[str, str]] = []
    turns = []
    for i, user in enumerate(q.turns):
        messages.append({"role": "user", "content": user})
        t = method.turn(messages, max_new, temperature, seed + 1000 * q.question_id + i)
        turns.append(t)
        messages.append({"role": "assistant", "content": t.text})
    return turns


# ------------------------------------------------------------------------------------------- files


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: that question is simply redone
    return out


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a+b") as f:
        f.seek(0, 2)
        if f.tell():  # a line cut by a kill must not swallow this record
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record) + "\n").encode())


def answer_record(q: Question, model_id: str, turns: list[Turn]) -> dict[str, Any]:
    return {
        "question_id": q.question_id, "category": q.category, "answer_id": uuid.uuid4().hex[:22],
        "model_id": model_id,
        "choices": [{"index": 0, "turns": [t.text for t in turns], "new_tokens": [len(t.tokens) for t in turns],
                     "wall_time": [t.wall_time for t in turns],
                     "accept_lengths": [a for t in turns for a in t.accept_lengths]}],
        "tstamp": time.time(),
    }


def question_key(q: Question) -> str:
    """A short hash of a question's turns: a resumed run must be answering the same questions."""
    return hashlib.sha256(json.dumps(q.turns).encode()).hexdigest()[:16]


def raw_record(q: Question, turns: list[Turn]) -> dict[str, Any]:
    return {"question_id": q.question_id, "category": q.category, "key": question_key(q),
            "tokens": [t.tokens for t in turns],
            "wall_time": [t.wall_time for t in turns], "accept_lengths": [t.accept_lengths for t in turns],
            "target_passes": [t.target_passes for t in turns], "draft_steps": [t.draft_steps for t in turns],
            "drafter_states": [t.drafter_states for t in turns],
            "accepted_drafts": [t.accepted_drafts for t in turns],
            "drafter_macs": [t.drafter_macs for t in turns]}


def finalize_answers(path: Path) -> None:
    """Sort by question_id, keep the newest line per question."""
    latest: dict[int, dict[str, Any]] = {}
    for rec in _read_jsonl(path):
        latest[rec["question_id"]] = rec
    path.write_text("".join(json.dumps(latest[k]) + "\n" for k in sorted(latest)))


# ------------------------------------------------------------------------------------------ report


def _speed(rec: dict[str, Any]) -> float:
    return sum(len(t) for t in rec["tokens"]) / max(sum(rec["wall_time"]), 1e-9)


def summarize(raw: dict[str, list[dict[str, Any]]], external: set[str], greedy: bool) -> dict[str, Any]:
    """Per method, per category and overall: Spec-Bench speed, speed-up, accepted length, counters."""
    base = {r["question_id"]: r for r in raw.get("ar", [])}
    categories = sorted({r["category"] for rs in raw.values() for r in rs})
    out: dict[str, Any] = {}
    for method, recs in raw.items():
        rows = {}
        for cat in [*categories, "overall"]:
            rs = [r for r in recs if cat == "overall" or r["category"] == cat]
            if not rs:
                continue
            speed = statistics.mean(_speed(r) for r in rs)
            bs = [base[r["question_id"]] for r in rs if r["question_id"] in base]
            rounds = [a for r in rs for turn in r["accept_lengths"] for a in turn]
            tokens = sum(len(t) for r in rs for t in r["tokens"])
            row = {"questions": len(rs), "tokens_per_s": speed,
                   "speedup_vs_ar": speed / statistics.mean(_speed(b) for b in bs) if bs else None,
                   "mean_accepted_length": statistics.mean(rounds) if rounds else None}
            if method not in external:
                passes = sum(sum(r["target_passes"]) for r in rs)
                row["target_passes_per_token"] = passes / tokens if tokens else None
                row["draft_steps_per_token"] = sum(sum(r["draft_steps"]) for r in rs) / tokens if tokens else None
                states = sum(sum(r.get("drafter_states", [0])) for r in rs)
                accepted = sum(sum(r["accepted_drafts"]) for r in rs)
                row["draft_utilisation"] = accepted / states if states else None
                macs = sum(sum(r.get("drafter_macs", [0.0])) for r in rs)
                row["drafter_mmacs_per_token"] = macs / 1e6 / tokens if tokens and macs else None
                row["drafter_mmacs_per_accepted"] = macs / 1e6 / accepted if accepted and macs else None
            if greedy and bs:
                row["identical_to_ar"] = all(r["tokens"] == base[r["question_id"]]["tokens"] for r in rs
                                         if r["question_id"] in base)
            rows[cat] = row
        out[method] = {"external": method in external, "by_category": rows}
    return out


def accept_histogram(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[int, int]]:
    hist: dict[str, dict[int, int]] = {}
    for method, recs in raw.items():
        h: dict[int, int] = {}
        for r in recs:
            for turn in r["accept_lengths"]:
                for a in turn:
                    h[a] = h.get(a, 0) + 1
        if h:
            hist[method] = dict(sorted(h.items()))
    return hist


def per_depth_acceptance(hist: dict[int, int]) -> list[float]:
    """P(at least d drafts accepted | a round), d = 1, 2, ... (a round emits accepted drafts + 1)."""
    total = sum(hist.values())
    top = max(hist) if hist else 0
    return [sum(c for a, c in hist.items() if a >= d + 1) / total for d in range(1, top)]


def _fmt(v: Any, spec: str = ".2f", suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:{spec}}{suffix}"


def report_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# hsdjax bench: {meta['model']}", "",
             f"{meta['questions']} questions ({', '.join(meta['files'])}; {meta.get('selection', 'all')}), up to {meta['max_new_tokens']} new tokens "
             f"per turn, temperature {meta['temperature']}, {meta['started']}. Speed: Spec-Bench arithmetic (mean over "
             "questions of new tokens / wall time; speed-up = ratio of means vs `ar`; compile excluded).", ""]
    cats = sorted({c for m in summary.values() for c in m["by_category"] if c != "overall"}) + ["overall"]
    lines += ["Speed-up over `ar` by category (Spec-Bench arithmetic):", "",
              "| method | " + " | ".join(cats) + " | identical to ar |", "|" + " --- |" * (len(cats) + 2)]
    for method, m in summary.items():
        cells = [_fmt((m["by_category"].get(c) or {}).get("speedup_vs_ar"), ".2f", "x") for c in cats]
        name = f"{method} (external)" if m["external"] else method
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(m['by_category']['overall'].get('identical_to_ar'))} |")
    lines += ["", "Per category:", ""]
    header = ("| method | category | questions | tokens/s | speed-up vs ar | mean accepted length | "
              "target passes / token | drafter passes (chain steps) / token | draft utilisation | "
              "drafter M multiply-adds / accepted draft | identical to ar |")
    lines += [header, "|" + " --- |" * 11]
    for cat in cats:
        for method, m in summary.items():
            row = m["by_category"].get(cat)
            if not row:
                continue
            name = f"{method} (external)" if m["external"] else method
            lines.append(f"| {name} | {cat} | {row['questions']} | {_fmt(row['tokens_per_s'], '.1f')} | "
                         f"{_fmt(row['speedup_vs_ar'], '.2f', 'x')} | {_fmt(row['mean_accepted_length'])} | "
                         f"{_fmt(row.get('target_passes_per_token'), '.3f')} | "
                         f"{_fmt(row.get('draft_steps_per_token'), '.3f')} | "
                         f"{_fmt(row.get('draft_utilisation'), '.3f')} | "
                         f"{_fmt(row.get('drafter_mmacs_per_accepted'), '.2f')} | {_fmt(row.get('identical_to_ar'))} |")
    for note in meta.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def write_plots(out: Path, summary: dict[str, Any], hist: dict[str, dict[int, int]]) -> list[str]:
    """PNG plots; returns their file names (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    cats = sorted({c for m in summary.values() for c in m["by_category"] if c != "overall"}) + ["overall"]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(summary)}  # one colour per method everywhere
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.25 * len(cats) * len(summary))), 4.5))
    width = 0.8 / max(1, len(summary))
    for i, (method, m) in enumerate(summary.items()):
        vals = [(m["by_category"].get(c) or {}).get("speedup_vs_ar") or 0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=method, color=colors[method])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(summary) - 1) / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speed-up over ar")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=110)
    plt.close(fig)
    written.append("speedup_by_category.png")
    if hist:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for method, h in hist.items():
            total = sum(h.values())
            a1.plot(list(h), [c / total for c in h.values()], marker="o", label=method, color=colors[method])
            depth = per_depth_acceptance(h)
            if depth:
                a2.plot(range(1, len(depth) + 1), depth, marker="o", label=method, color=colors[method])
        a1.set_xlabel("tokens per target pass")
        a1.set_ylabel("share of rounds")
        a1.legend()
        a2.set_xlabel("draft depth d")
        a2.set_ylabel("P(at least d drafts accepted)")
        a2.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=110)
        plt.close(fig)
        written.append("acceptance.png")
    return written


# --------------------------------------------------------------------------------------------- run


def run_bench(model_name: str | None, methods: Sequence[str], question_files: Sequence[str], out: str | Path, *,
              max_new_tokens: int = 256, temperature: float = 0.0, limit: int | None = None,
              per_category: int | None = None, seed: int = 0, peer_dtype: str = "float32",
              method_options: dict[str, Any] | None = None, progress: bool = True, mesh: Any = None) -> dict[str, Any]:
    """Run (or resume) a benchmark; returns the report dict (also written to OUT/report.json).

    ``mesh`` (see ``hsdjax.sharding.make_mesh``) shards the target; None: one device."""
    unknown = [m for m in methods if m not in METHODS and m not in PEERS]
    if unknown:
        raise HsdjaxError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(METHODS)}, "
                          f"peers: {', '.join(PEERS)}")
    started = time.strftime("%Y-%m-%d %H:%M")
    questions, notes = select_questions(question_files, limit, per_category)
    out = Path(out)
    options = {k: v for k, v in (method_options or {}).items() if v is not None}
    model = load_model(model_name, mesh=mesh)
    runners, workers = make_runners(model, list(dict.fromkeys(["ar", *methods])), options, temperature, peer_dtype,
                                    notes)
    settings = {"model": model.name, "fingerprint": model.fingerprint, "max_new_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "peer_dtype": peer_dtype,
                "methods": {r.name: r.settings() for r in runners}}
    try:
        _check_settings(out, settings)
        started = json.loads((out / "run.json").read_text()).get("started", started)
        _answer_all(out, model.name, runners, questions, max_new_tokens, temperature, seed, progress)
    finally:
        for w in workers:
            w.close()
    selection = ", ".join(x for x in (f"first {per_category} per category" if per_category else "",
                                       f"first {limit} per file" if limit else "") if x) or "all"
    meta = {"model": model.name, "questions": len(questions), "files": [Path(f).name for f in question_files],
            "selection": selection, "method_options": options, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "notes": notes, "started": started}
    return write_report(out, runners, questions, meta)


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """A resumed run must use the settings its earlier answers were made with (kept in OUT/run.json)."""
    (out / "answers").mkdir(parents=True, exist_ok=True)
    (out / "raw").mkdir(exist_ok=True)
    path = out / "run.json"
    before = json.loads(path.read_text()) if path.exists() else {}
    changed = [k for k in settings if k != "methods" and k in before and before[k] != settings[k]]
    changed += [m for m, v in settings["methods"].items() if m in before.get("methods", {}) and before["methods"][m] != v]
    if changed:
        was = ", ".join(f"{k}={before.get(k, before.get('methods', {}).get(k))!r}" for k in changed)
        raise HsdjaxError(f"{out} holds answers made with {was}; resume with the same settings or use a new --out")
    merged = {"started": time.strftime("%Y-%m-%d %H:%M"), **before, **settings,
              "methods": {**before.get("methods", {}), **settings["methods"]}}
    path.write_text(json.dumps(merged, indent=1))  # methods added by a later run join the record


def make_runners(model: Any, methods: list[str], options: dict[str, Any], temperature: float, peer_dtype: str,
                 notes: list[str]) -> tuple[list[Any], list[Any]]:
    """Local methods and peers (over shared worker processes) that can run here; the rest are noted."""
    draft = draft_model_of(model, options.get("draft_model"))
    runners: list[Any] = []
    peer_names = []
    for m in methods:
        if m in PEERS:
            why = peer_available(m)
            if why is None and m == "hf-assisted" and not draft:
                why = f"{m} skipped: {model.name} has no draft model of its tokenizer"
            if why is None and temperature > 0:
                why = f"{m} skipped: peers decode greedily only (temperature {temperature} asked)"
            if why:
                notes.append(why)
            else:
                peer_names.append(m)
        elif m == "sps" and not draft:
            notes.append(f"sps skipped: {model.name} has no draft model of its tokenizer")
        elif m in FEATURE_METHODS and not options.get("drafter") and not has_shipped_drafter(model.name, m):
            notes.append(f"{m} skipped: no {m} drafter for {model.name} (train one with `hsdjax train-drafter`)")
        else:
            runners.append(LocalMethod(Generator(model, m, **options_for(m, options))))
    peers, workers = start_peers(peer_names, model.name, model.tokenizer.stop_ids, dtype=peer_dtype, draft=draft)
    if peer_dtype != "float32" and any(PEERS[m][0] == "hf" for m in peer_names):
        notes.append(f"transformers peers ran in {peer_dtype} (hsdjax: {model.cfg.dtype})")
    if "llamacpp" in peers:
        notes.append("llamacpp runs the GGUF's quantized kernels (weights as shipped, activations quantized "
                     "on the fly), not float32 on the dequantized weights, so its greedy tokens may differ from ar")
    return runners + [PeerMethod(peers[m], model.tokenizer) for m in peer_names], workers


def _answer_all(out: Path, model_name: str, runners: list[Any], questions: list[Question], max_new: int,
                temperature: float, seed: int, progress: bool) -> None:
    """Every runner on every question not answered yet, interleaved, each answer appended as it is done."""
    keys = {q.question_id: question_key(q) for q in questions}
    done: dict[str, set[int]] = {}
    for r in runners:
        done[r.name] = set()
        for rec in _read_jsonl(out / "raw" / f"{r.name}.jsonl"):
            qid = rec["question_id"]
            if qid in keys and rec.get("key", keys[qid]) != keys[qid]:
                raise HsdjaxError(f"{out}: question {qid} was answered for another question text (other question "
                                  "files or another order?); use the same --questions or a new --out")
            done[r.name].add(qid)
    todo = [(q, r) for i, q in enumerate(questions) for r in _rotate(runners, i) if q.question_id not in done[r.name]]
    if todo:
        for r in runners:  # peers load in the background while local methods compile
            if isinstance(r, PeerMethod) and any(rr is r for _, rr in todo):
                r.peer.worker.start()
        _warm_up([r for r in runners if any(rr is r for _, rr in todo)], questions[0], max_new, temperature, seed)
    bars = _bars([r.name for r in runners], [sum(r is rr for _, rr in todo) for r in runners], progress)
    try:
        for q, r in todo:
            turns = answer_question(r, q, max_new, temperature, seed)
            # the answer first: the raw record marks the question done
            _append_jsonl(out / "answers" / f"{r.name}.jsonl", answer_record(q, f"{model_name}-{r.name}", turns))
            _append_jsonl(out / "raw" / f"{r.name}.jsonl", raw_record(q, turns))
            bars[r.name].set_postfix_str(f"q{q.question_id}")
            bars[r.name].update(1)
    finally:
        for bar in bars.values():
            bar.close()
    for r in runners:
        finalize_answers(out / "answers" / f"{r.name}.jsonl")


def write_report(out: Path, runners: list[Any], questions: list[Question], meta: dict[str, Any]) -> dict[str, Any]:
    """report.json, report.md and the plots, over the selected questions of these runners."""
    wanted = {q.question_id for q in questions}
    raw = {}
    for r in runners:
        recs = {rec["question_id"]: rec for rec in _read_jsonl(out / "raw" / f"{r.name}.jsonl")
                if rec["question_id"] in wanted}  # the newest record per question
        raw[r.name] = [recs[k] for k in sorted(recs)]
    summary = summarize(raw, {r.name for r in runners if r.external}, meta["temperature"] == 0)
    hist = accept_histogram(raw)
    report = {"meta": meta, "summary": summary, "accept_histogram": hist,
              "per_depth_acceptance": {m: per_depth_acceptance(h) for m, h in hist.items()}}
    report["plots"] = write_plots(out, summary, hist)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(summary, meta))
    return report


def _rotate(items: list[Any], i: int) -> list[Any]:
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


def _warm_up(runners: Iterable[Any], q: Question, max_new: int, temperature: float, seed: int) -> None:
    """Compile every local method for this question's shapes and let peers load, before timing."""
    for r in runners:
        if isinstance(r, PeerMethod):
            r.peer.wait_ready()
        answer_question(r, q, min(max_new, 16), temperature, seed)


def _bars(names: list[str], totals: list[int], enabled: bool) -> dict[str, Any]:
    """One progress bar (with its own ETA) per method."""
    from tqdm.auto import tqdm

    width = max((len(n) for n in names), default=0)
    return {n: tqdm(total=t, desc=n.ljust(width), unit="answer", position=i, disable=not enabled,
                    dynamic_ncols=True, leave=True)
            for i, (n, t) in enumerate(zip(names, totals))}
