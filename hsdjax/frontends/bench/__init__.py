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

One module per concern:

* ``questions`` -- question files, the selection, a question's prompts turn by turn (also ``hsdjax tune``'s);
* ``runners`` -- our methods and the peers behind one call, warm-up, the interleaving;
* ``store`` -- the resumable results under OUT;
* ``report`` -- the arithmetic, report.md / report.json and the plots;
* ``run`` -- ``run_bench``, which ties them together.
"""

from __future__ import annotations

from hsdjax.frontends.bench.questions import Question, read_questions, select_questions
from hsdjax.frontends.bench.run import run_bench

__all__ = ["Question", "read_questions", "run_bench", "select_questions"]
