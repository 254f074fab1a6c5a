"""The resumable results store of ``hsdjax bench`` under OUT:

* ``answers/<method>.jsonl`` -- Spec-Bench answer files (sorted by ``question_id``, one line per question
  once finalized), readable by Spec-Bench's ``speed.py`` / ``equal.py``;
* ``raw/<method>.jsonl`` -- token ids and engine counters per turn (what resume and the report read);
* ``run.json`` -- the settings the answers were made with, which a resumed run must match.

Every answer is appended as soon as it is made, so a killed run continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

from hsdjax.errors import HsdjaxError
from hsdjax.frontends.bench.questions import Question
from hsdjax.frontends.bench.runners import Turn


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: that question is simply redone
    return out


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
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
            "wall_time": [t.wall_time for t in turns], "decode_time": [t.decode_s for t in turns],
            "accept_lengths": [t.accept_lengths for t in turns],
            "target_passes": [t.target_passes for t in turns], "draft_passes": [t.draft_passes for t in turns],
            "drafter_states": [t.drafter_states for t in turns],
            "accepted_drafts": [t.accepted_drafts for t in turns],
            "lookup_drafts": [t.lookup_drafts for t in turns],
            "drafter_macs": [t.drafter_macs for t in turns],
            "reused_drafts": [t.stats.get("reused_drafts", 0) for t in turns]}


def check_settings(out: Path, settings: dict[str, Any]) -> str:
    """A resumed run must use the settings its earlier answers were made with (kept in OUT/run.json);
    records the settings (methods added by a later run join them) and returns when the run started."""
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
    path.write_text(json.dumps(merged, indent=1))
    return merged["started"]


def answered(out: Path, name: str, questions: Sequence[Question]) -> set[int]:
    """The ids of the questions method ``name`` has answered; refused when one was another question's text."""
    keys = {q.question_id: question_key(q) for q in questions}
    done = set()
    for rec in read_jsonl(out / "raw" / f"{name}.jsonl"):
        qid = rec["question_id"]
        if qid in keys and rec.get("key", keys[qid]) != keys[qid]:
            raise HsdjaxError(f"{out}: question {qid} was answered for another question text (other question "
                              "files or another order?); use the same --questions or a new --out")
        done.add(qid)
    return done


def save_answer(out: Path, model_id: str, name: str, q: Question, turns: list[Turn]) -> None:
    """Append one answer: the answer file first, since the raw record marks the question done."""
    append_jsonl(out / "answers" / f"{name}.jsonl", answer_record(q, model_id, turns))
    append_jsonl(out / "raw" / f"{name}.jsonl", raw_record(q, turns))


def finalize_answers(path: Path) -> None:
    """Sort by question_id, keep the newest line per question."""
    latest: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(path):
        latest[rec["question_id"]] = rec
    path.write_text("".join(json.dumps(latest[k]) + "\n" for k in sorted(latest)))


def load_raw(out: Path, names: Iterable[str], question_ids: set[int]) -> dict[str, list[dict[str, Any]]]:
    """Per method, the newest raw record of each of these questions, by question id."""
    raw = {}
    for name in names:
        recs = {rec["question_id"]: rec for rec in read_jsonl(out / "raw" / f"{name}.jsonl")
                if rec["question_id"] in question_ids}
        raw[name] = [recs[k] for k in sorted(recs)]
    return raw
