"""``run_bench``: one ``hsdjax bench`` run end to end -- choose the questions, start the methods, answer
every question not answered yet (interleaved, each answer stored as it is made), then the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from hsdjax.core.methods import METHODS
from hsdjax.errors import HsdjaxError
from hsdjax.frontends.api import load_model
from hsdjax.frontends.bench import store
from hsdjax.frontends.bench.questions import Question, select_questions
from hsdjax.frontends.bench.report import write_report
from hsdjax.frontends.bench.runners import answer_question, make_runners, rotations, warm_up
from hsdjax.frontends.peers import PEERS


def run_bench(model_name: str | None, methods: Sequence[str], question_files: Sequence[str], out: str | Path, *,
              max_new_tokens: int = 256, temperature: float = 0.0, limit: int | None = None,
              per_category: int | None = None, seed: int = 0, peer_dtype: str = "float32",
              method_options: dict[str, Any] | None = None, progress: bool = True, mesh: Any = None) -> dict[str, Any]:
    """Run (or resume) a benchmark; returns the report dict (also written to OUT/report.json).

    ``mesh`` (see ``hsdjax.runtime.sharding.make_mesh``) shards the target; None: one device."""
    unknown = [m for m in methods if m not in METHODS and m not in PEERS]
    if unknown:
        raise HsdjaxError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(METHODS)}, "
                          f"peers: {', '.join(PEERS)}")
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
        started = store.check_settings(out, settings)
        answer_all(out, model.name, runners, questions, max_new_tokens, temperature, seed, progress)
        peer_builds = sorted({r.peer.worker.info["build"] for r in runners
                              if getattr(r, "external", False) and r.peer.worker.info.get("build")})
    finally:
        for w in workers:
            w.close()
    selection = ", ".join(x for x in (f"first {per_category} per category" if per_category else "",
                                       f"first {limit} per file" if limit else "") if x) or "all"
    meta = {"model": model.name, "questions": len(questions), "files": [Path(f).name for f in question_files],
            "selection": selection, "method_options": options, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "notes": notes, "started": started,
            "machine": "; ".join([machine_line(model), *(f"peer: {b}" for b in peer_builds)])}
    raw = store.load_raw(out, [r.name for r in runners], {q.question_id for q in questions})
    return write_report(out, raw, {r.name for r in runners if r.external}, meta)


def machine_line(model: Any) -> str:
    """Where the figures were measured: the CPU model and its vector extensions (or the accelerator),
    and the path hsdjax's matmuls took."""
    import jax

    from hsdjax.kernels import cpu_matmul

    device = (f"CPU {cpu_matmul.cpu_summary()}" if jax.default_backend() == "cpu"
              else f"{jax.default_backend()}: {jax.devices()[0].device_kind}")
    return f"{device}; hsdjax: {model.backend_line() or 'XLA'}"


def answer_all(out: Path, model_name: str, runners: list[Any], questions: list[Question], max_new: int,
               temperature: float, seed: int, progress: bool) -> None:
    """Every runner on every question not answered yet, interleaved, each answer stored as it is done."""
    done = {r.name: store.answered(out, r.name, questions) for r in runners}
    todo = [(q, r) for q, order in rotations(questions, runners) for r in order if q.question_id not in done[r.name]]
    active = [r for r in runners if any(rr is r for _, rr in todo)]
    if todo:
        warm_up(active, lambda r: answer_question(r, questions[0], min(max_new, 16), temperature, seed))
    bars = _bars([r.name for r in runners], [sum(r is rr for _, rr in todo) for r in runners], progress)
    try:
        for q, r in todo:
            store.save_answer(out, f"{model_name}-{r.name}", r.name, q,
                              answer_question(r, q, max_new, temperature, seed))
            bars[r.name].set_postfix_str(f"q{q.question_id}")
            bars[r.name].update(1)
    finally:
        for bar in bars.values():
            bar.close()
    for r in runners:
        store.finalize_answers(out / "answers" / f"{r.name}.jsonl")


def _bars(names: list[str], totals: list[int], enabled: bool) -> dict[str, Any]:
    """One progress bar (with its own ETA) per method."""
    from tqdm.auto import tqdm

    width = max((len(n) for n in names), default=0)
    return {n: tqdm(total=t, desc=n.ljust(width), unit="answer", position=i, disable=not enabled,
                    dynamic_ncols=True, leave=True)
            for i, (n, t) in enumerate(zip(names, totals))}
