"""Dev-set questions: reading Spec-Bench question files, choosing which to run, and turning a question
into a conversation turn by turn (each turn's prompt holds the earlier turns and their answers).

Shared by ``hsdjax bench``, ``hsdjax tune`` and the scripts in ``benchmarks/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hsdjax.errors import HsdjaxError
from hsdjax.jsonl import read_objects

Messages = list[dict[str, str]]


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
            qs = _first_per_category(qs, per_category)
        out += qs[:limit]
    return out, notes


def _first_per_category(questions: list[Question], n: int) -> list[Question]:
    counts: dict[str, int] = {}
    keep = []
    for q in questions:
        counts[q.category] = counts.get(q.category, 0) + 1
        if counts[q.category] <= n:
            keep.append(q)
    return keep


def converse(turns: Sequence[str], respond: Callable[[Messages, int], Any]) -> tuple[Messages, list[Any]]:
    """Ask ``turns`` one by one: ``respond(messages, i)`` answers turn i with a result that has a ``.text``,
    which joins the conversation before the next turn. Returns the conversation and the results."""
    messages: Messages = []
    results = []
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        result = respond(messages, i)
        results.append(result)
        messages.append({"role": "assistant", "content": result.text})
    return messages, results


def turn_prompt(gen: Any, turns: Sequence[str], turn: int, max_new: int) -> list[int]:
    """Token ids of the prompt of ``turn`` (1-based; the last turn when there are fewer), the earlier turns
    answered greedily by the ``hsdjax.frontends.api.Generator`` ``gen``."""
    turn = min(turn, len(turns))
    messages, _ = converse(turns[: turn - 1], lambda m, i: gen.generate(m, max_new_tokens=max_new)[0])
    return gen.encode_prompt([*messages, {"role": "user", "content": turns[turn - 1]}])


def build_prompts(gen: Any, questions: Sequence[Question], turn: int, max_new: int) -> list[list[int]]:
    """``turn_prompt`` of each question."""
    return [turn_prompt(gen, q.turns, turn, max_new) for q in questions]


DEV_SETS = (("mt_bench", 1), ("mt_bench", 2), ("gsm8k", 1), ("humaneval", 1), ("alpaca", 1))  # (file, turn)


def dev_set_prompts(gen: Any, folder: str | Path, limit: int, max_new: int) -> list[tuple[str, list[int]]]:
    """(``set/tTURN``, token ids) for the first ``limit`` questions of each dev set and turn in ``folder``
    (the Spec-Bench question files; the prompts of ``benchmarks/feature_drafters.py``)."""
    return [(f"{name}/t{turn}", ids) for name, turn in DEV_SETS
            for ids in build_prompts(gen, read_questions(Path(folder) / f"{name}.jsonl")[:limit], turn, max_new)]

