"""`hsdjax bench`: answer files in the Spec-Bench schema, resume without duplicates, bad input."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from hsdjax.errors import HsdjaxError
from hsdjax.frontends.bench import read_questions, select_questions

QUESTIONS = [
    {"question_id": 7, "category": "writing", "turns": ["Name two primary colours.", "Now name a third."],
     "extra": "ignored"},
    {"question_id": 3, "category": "coding", "turns": ["Write a Python one-liner that reverses a string s."]},
]


def check_answer_file(path, ids):
    lines = path.read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["question_id"] for r in recs] == sorted(ids)
    for r in recs:
        assert set(r) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
        assert isinstance(r["answer_id"], str) and isinstance(r["tstamp"], float)
        (choice,) = r["choices"]
        assert set(choice) == {"index", "turns", "new_tokens", "wall_time", "accept_lengths"}
        n = len(choice["turns"])
        assert n == len(choice["new_tokens"]) == len(choice["wall_time"]) >= 1
        assert all(isinstance(t, str) for t in choice["turns"])
        assert all(isinstance(x, int) and x > 0 for x in choice["new_tokens"])
        assert all(isinstance(x, float) and x > 0 for x in choice["wall_time"])
    return recs


def test_bench_two_questions_two_methods(tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hsdjax.frontends.cli", "bench", "--methods", "ar,pld,hf-ar,hf-pld,hf-assisted,llamacpp",
           "--questions", str(qfile), "--max-new-tokens", "24", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    assert sorted(p.name for p in (out / "answers").iterdir()) == [
        "ar.jsonl", "hf-ar.jsonl", "hf-pld.jsonl", *(["llamacpp.jsonl"] if has_llamacpp else []), "pld.jsonl"]
    ar = check_answer_file(out / "answers" / "ar.jsonl", [3, 7])
    pld = check_answer_file(out / "answers" / "pld.jsonl", [3, 7])
    assert [len(r["choices"][0]["turns"]) for r in ar] == [1, 2]
    assert [r["choices"][0]["turns"] for r in ar] == [r["choices"][0]["turns"] for r in pld]  # greedy: identical
    report = json.loads((out / "report.json").read_text())
    overall = report["summary"]["pld"]["by_category"]["overall"]
    assert overall["identical_to_ar"] is True and overall["speedup_vs_ar"] > 0
    assert report["summary"]["pld"]["alone"]["decode_tokens_per_s"] > 0  # decode alone (prefill excluded)
    assert "turn_2_speedup_vs_ar" in report["summary"]["pld"]["alone"]
    # transformers (one worker serving plain and prompt-lookup decoding) on the same weights: same tokens
    for peer in ("hf-ar", "hf-pld"):
        assert report["summary"][peer]["external"] is True
        assert report["summary"][peer]["by_category"]["overall"]["identical_to_ar"] is True
    assert any("hf-assisted skipped" in n for n in report["meta"]["notes"])  # SmolLM2 has no draft model
    assert "hf-assisted skipped" in (out / "report.md").read_text()
    if has_llamacpp:  # the GGUF as shipped, quantized kernels: its own tokens, marked external
        check_answer_file(out / "answers" / "llamacpp.jsonl", [3, 7])
        assert report["summary"]["llamacpp"]["external"] is True
        assert any("quantized kernels" in n for n in report["meta"]["notes"])
        # the peers' builds are named beside the CPU (llama.cpp's instruction sets, from its system info)
        assert re.search(r"peer: llama\.cpp [\d.]+ built for \w", report["meta"]["machine"])
        assert "peer: torch " in report["meta"]["machine"]
    else:
        assert any("llamacpp skipped" in n and "hsdjax[llamacpp]" in n for n in report["meta"]["notes"])
    assert (out / "report.md").exists() and (out / "speedup_by_category.png").exists()
    # a rerun resumes: nothing is redone, nothing duplicated (our methods only: the peers' answers
    # go through the same store, and starting torch and llama.cpp again would double the test's time)
    before = {p.name: p.read_text() for p in (out / "answers").iterdir()}
    rerun = [*cmd[:5], "ar,pld", *cmd[6:]]
    proc = subprocess.run(rerun, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name: p.read_text() for p in (out / "answers").iterdir()} == before
    check_answer_file(out / "answers" / "ar.jsonl", [3, 7])
    # resuming with other settings would mix answers: refused in one line
    proc = subprocess.run([*cmd[:-4], "--max-new-tokens", "25", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "max_new_tokens=24" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("line,needle", [
    ('{"question_id": 1, "turns": ["hi"]', "not valid JSON"),
    ('{"question_id": "x", "turns": ["hi"]}', "'question_id' must be an integer"),
    ('{"question_id": 2, "turns": []}', "'turns' must be a non-empty list"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_question_file_names_the_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(QUESTIONS[1]) + "\n\n" + line + "\n")
    with pytest.raises(HsdjaxError, match=f"bad.jsonl:3: {needle}"):
        read_questions(path)


def test_bench_cli_rejects_unknown_method_and_bad_file(tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\nnot json\n')
    base = [sys.executable, "-m", "hsdjax.frontends.cli", "bench", "--out", str(tmp_path / "o"), "--questions", str(qfile)]
    proc = subprocess.run(base + ["--methods", "ar,nope"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown method" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "q.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr


def test_question_selection_per_category_and_colliding_ids(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question_id": i, "category": "xy"[i % 2], "turns": [f"q{i}"]}) + "\n"
                         for i in range(6)))
    b.write_text("".join(json.dumps({"question_id": i, "category": "z", "turns": [f"r{i}"]}) + "\n" for i in range(3)))
    qs, notes = select_questions([a, b], per_category=2)
    assert [q.question_id for q in qs] == [0, 1, 2, 3, 1000, 1001]  # b's ids collide with a's: renumbered
    assert [q.turns[0] for q in qs[4:]] == ["r0", "r1"] and "b.jsonl" in notes[0]
    qs, notes = select_questions([a, b], limit=1)
    assert [q.question_id for q in qs] == [0, 1000]
    qs, notes = select_questions([a], limit=2, per_category=1)
    assert [q.question_id for q in qs] == [0, 1] and notes == []


def test_renumbering_does_not_depend_on_the_selection(tmp_path):
    """Offsets come from whole files, so a resumed run with another --limit keys questions the same way."""
    a, c = tmp_path / "a.jsonl", tmp_path / "c.jsonl"
    a.write_text("".join(json.dumps({"question_id": i, "category": "x", "turns": [f"q{i}"]}) + "\n" for i in range(6)))
    c.write_text("".join(json.dumps({"question_id": i, "category": "y", "turns": [f"r{i}"]}) + "\n" for i in (4, 5)))
    for limit in (1, 2, None):
        qs, _ = select_questions([a, c], limit=limit)
        assert [q.question_id for q in qs if q.category == "y"] == [1004, 1005][:limit]


def test_a_line_cut_by_a_kill_does_not_swallow_the_next_record(tmp_path):
    from hsdjax.frontends.bench.store import append_jsonl, read_jsonl

    path = tmp_path / "raw.jsonl"
    append_jsonl(path, {"question_id": 1})
    with path.open("a") as f:
        f.write('{"question_id": 2, "tok')  # killed mid-write
    append_jsonl(path, {"question_id": 3})
    assert [r["question_id"] for r in read_jsonl(path)] == [1, 3]


def test_report_gives_decode_alone_the_median_question_and_each_turn():
    """The report's second table: decode-only speed (each turn's first token comes out of the prefill,
    so it is left out with the prefill's time), the median of per-question speed-ups and each turn alone,
    all against `ar`; records without decode times (older runs) leave those cells empty."""
    from hsdjax.frontends.bench.report import report_markdown, summarize

    def rec(qid, tokens, wall, decode=None):
        r = {"question_id": qid, "category": "c", "tokens": [[1] * n for n in tokens], "wall_time": wall,
             "accept_lengths": [[1] * n for n in tokens], "target_passes": list(tokens), "draft_passes": [0] * len(tokens),
             "accepted_drafts": [0] * len(tokens)}
        return r | ({"decode_time": decode} if decode else {})

    raw = {"ar": [rec(1, [11, 21], [1.0, 2.0], [0.5, 1.0]), rec(2, [11], [1.0], [0.5])],
           "pld": [rec(1, [11, 21], [0.5, 2.0], [0.25, 1.0]), rec(2, [11], [0.5], [0.25])],
           "old": [rec(1, [11, 21], [1.0, 1.0]), rec(2, [11], [2.0])]}
    s = summarize(raw, set(), greedy=True)
    pld, old = s["pld"]["alone"], s["old"]["alone"]
    # decode: ar 30/1.5 = 20 and 10/0.5 = 20 tok/s; pld 30/1.25 = 24 and 10/0.25 = 40
    assert pld["decode_tokens_per_s"] == pytest.approx(32.0) and pld["decode_speedup_vs_ar"] == pytest.approx(1.6)
    # whole questions: ar 32/3 and 11; pld 32/2.5 and 22 -> ratios 1.2 and 2.0
    assert pld["median_ratio_vs_ar"] == pytest.approx(1.6)
    assert pld["turn_1_speedup_vs_ar"] == pytest.approx(2.0) and pld["turn_2_speedup_vs_ar"] == pytest.approx(1.0)
    assert "decode_tokens_per_s" not in old and old["turn_2_speedup_vs_ar"] == pytest.approx(2.0)
    md = report_markdown(s, {"model": "m", "questions": 2, "files": ["q.jsonl"], "max_new_tokens": 32,
                             "temperature": 0.0, "started": "now"})
    assert "| pld | 32.0 | 1.60x | 1.60x | 2.00x | 1.00x |" in md
    assert "| old | - | - | 1.00x | 0.75x | 2.00x |" in md  # ratios 1.5 and 0.5; turn 1: 8.25 against 11
