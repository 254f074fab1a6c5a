"""The benchmark arithmetic and its presentation: speeds and speed-up ratios (Spec-Bench's: a question's
speed is its new tokens over its wall time, a method's speed the mean over questions, speed-up the ratio
of those means against ``ar``), accepted length, per-depth acceptance, per-category and per-set tables,
and ``hsdjax bench``'s report (``report.md``, ``report.json``, PNG plots).

Shared by ``hsdjax bench`` and the scripts in ``benchmarks/``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

# ------------------------------------------------------------------------------------------ arithmetic


def speed(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


def question_speed(rec: dict[str, Any]) -> float:
    """Spec-Bench's speed of one question (a raw record): new tokens over wall time, all turns."""
    return speed(sum(len(t) for t in rec["tokens"]), sum(rec["wall_time"]))


def turn_speed(rec: dict[str, Any], turn: int) -> float | None:
    """One turn's speed (new tokens over wall time); None where the question has no such turn."""
    if turn >= len(rec["tokens"]):
        return None
    return speed(len(rec["tokens"][turn]), rec["wall_time"][turn])


def decode_speed(rec: dict[str, Any]) -> float | None:
    """Decode-only speed of one question: new tokens after each turn's first (which comes out of the
    prefill) over the decode seconds, all turns; None for records without decode times."""
    times = rec.get("decode_time")
    tokens = sum(len(t) - 1 for t in rec["tokens"])
    if not times or sum(times) <= 0 or tokens <= 0:
        return None
    return speed(tokens, sum(times))


def speedup(speeds: Iterable[float], base: Iterable[float]) -> float:
    """Spec-Bench's speed-up: the ratio of the mean speeds."""
    return statistics.mean(speeds) / statistics.mean(base)


def median_ratio(speeds: Sequence[float], base: Sequence[float]) -> float:
    """The median of per-question speed ratios."""
    return statistics.median(a / b for a, b in zip(speeds, base))


def accepted_length(decoded: int, passes: int) -> float:
    """Tokens per target pass (decoded tokens: those after the first, which comes out of the prefill)."""
    return decoded / max(passes, 1)


def count_rounds(accept_lengths: Iterable[int]) -> dict[int, int]:
    """Histogram of tokens emitted per round (accepted drafts + 1), sorted."""
    h: dict[int, int] = {}
    for a in accept_lengths:
        h[a] = h.get(a, 0) + 1
    return dict(sorted(h.items()))


def _rounds_accepting(hist: dict[int, int], d: int) -> int:
    """Rounds that accepted at least ``d`` drafts."""
    return sum(c for a, c in hist.items() if a >= d + 1)


def per_depth_acceptance(hist: dict[int, int]) -> list[float]:
    """P(at least d drafts accepted | a round), d = 1, 2, ... (a round emits accepted drafts + 1)."""
    total = sum(hist.values())
    top = max(hist) if hist else 0
    return [_rounds_accepting(hist, d) / total for d in range(1, top)]


def acceptance_given_reach(hist: dict[int, int], depths: int) -> list[float]:
    """P(at least d drafts accepted | at least d - 1 were), d = 1 .. depths (0 where no round got there)."""
    reach = [_rounds_accepting(hist, d) for d in range(depths + 1)]
    return [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, depths + 1)]


def by_set(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per ``set`` of the rows (``tokens``, ``decode_s``, ``target_passes``, paired with ``base``'s rows):
    accepted length, and decode speed against the base as the ratio of summed times."""
    out = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        pairs = [(r, b) for r, b in zip(rows, base) if r["set"] == name]
        toks = sum(len(r["tokens"]) - 1 for r, _ in pairs)
        passes = sum(r["target_passes"] for r, _ in pairs)
        own = speed(toks, sum(r["decode_s"] for r, _ in pairs))
        base_speed = speed(sum(len(b["tokens"]) - 1 for _, b in pairs), sum(b["decode_s"] for _, b in pairs))
        out[name] = {"accepted_length": accepted_length(toks, passes), "speedup": own / base_speed}
    return out


# ------------------------------------------------------------------------------- hsdjax bench's summary


def summarize(raw: dict[str, list[dict[str, Any]]], external: set[str], greedy: bool) -> dict[str, Any]:
    """Per method, per category and overall: Spec-Bench speed, speed-up, accepted length, counters."""
    base = {r["question_id"]: r for r in raw.get("ar", [])}
    categories = sorted({r["category"] for rs in raw.values() for r in rs})
    out: dict[str, Any] = {}
    for method, recs in raw.items():
        rows = {}
        for cat in [*categories, "overall"]:
            rs = [r for r in recs if cat == "overall" or r["category"] == cat]
            if rs:
                rows[cat] = _summary_row(rs, base, method not in external, greedy)
        if greedy and method == "llamacpp-pld" and raw.get("llamacpp"):  # lossless against its own plain decoding?
            _identical_to(rows, recs, raw["llamacpp"], "identical_to_llamacpp")
        out[method] = {"external": method in external, "by_category": rows,
                       "alone": _decode_and_turns(recs, base)}
    return out


def _paired(recs: list[dict[str, Any]], base: dict[int, dict[str, Any]], fn: Any) -> tuple[list[float], list[float]]:
    """``fn`` of each record and of ``ar``'s record of the same question, where both are defined."""
    pairs = [(fn(r), fn(base[r["question_id"]])) for r in recs if r["question_id"] in base]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _decode_and_turns(recs: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Over all questions: decode-only speed (prefill excluded) and its speed-up, the median of
    per-question speed-ups, and the speed-up of each turn alone (Spec-Bench arithmetic within it)."""
    out: dict[str, Any] = {}
    own, ar = _paired(recs, base, decode_speed)
    if own:
        out["decode_tokens_per_s"] = statistics.mean(own)
        out["decode_speedup_vs_ar"] = speedup(own, ar)
    own, ar = _paired(recs, base, question_speed)
    if own:
        out["median_ratio_vs_ar"] = median_ratio(own, ar)
    turns = max((len(r["tokens"]) for r in recs), default=0)
    for t in range(turns):
        own, ar = _paired(recs, base, lambda r, t=t: turn_speed(r, t))
        if own:
            out[f"turn_{t + 1}_speedup_vs_ar"] = speedup(own, ar)
    return out


def _summary_row(rs: list[dict[str, Any]], base: dict[int, dict[str, Any]], local: bool,
                 greedy: bool) -> dict[str, Any]:
    speeds = [question_speed(r) for r in rs]
    bs = [base[r["question_id"]] for r in rs if r["question_id"] in base]
    rounds = [a for r in rs for turn in r["accept_lengths"] for a in turn]
    row = {"questions": len(rs), "tokens_per_s": statistics.mean(speeds),
           "speedup_vs_ar": speedup(speeds, (question_speed(b) for b in bs)) if bs else None,
           "mean_accepted_length": statistics.mean(rounds) if rounds else None}
    if local:
        row |= _counters(rs)
    if greedy and bs:
        row["identical_to_ar"] = all(r["tokens"] == base[r["question_id"]]["tokens"] for r in rs
                                     if r["question_id"] in base)
    return row


def _identical_to(rows: dict[str, Any], recs: list[dict[str, Any]], other: list[dict[str, Any]], key: str) -> None:
    """rows[cat][key]: whether every answer in recs equals the same question's answer in other."""
    theirs = {r["question_id"]: r["tokens"] for r in other}
    for cat, row in rows.items():
        pairs = [(r["tokens"], theirs[r["question_id"]]) for r in recs
                 if (cat == "overall" or r["category"] == cat) and r["question_id"] in theirs]
        if pairs:
            row[key] = all(a == b for a, b in pairs)


def _counters(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """A local method's work per token: target passes, drafter passes, utilisation, multiply-adds."""
    tokens = sum(len(t) for r in rs for t in r["tokens"])
    passes = sum(sum(r["target_passes"]) for r in rs)
    states = sum(sum(r.get("drafter_states", [0])) for r in rs)
    # the drafter's own accepted drafts (a grafted lookup chain's cost no drafter work; older records lack them)
    accepted = sum(sum(r["accepted_drafts"]) - sum(r.get("lookup_drafts", [0])) for r in rs)
    macs = sum(sum(r.get("drafter_macs", [0.0])) for r in rs)
    reused = sum(sum(r.get("reused_drafts", [0])) for r in rs)
    return {"target_passes_per_token": passes / tokens if tokens else None,
            "draft_passes_per_token": sum(sum(r.get("draft_passes", r.get("draft_steps", [0]))) for r in rs) / tokens
            if tokens else None,  # (records before 2026-12 named them draft_steps)
            "draft_utilisation": accepted / states if states else None,
            "drafter_mmacs_per_token": macs / 1e6 / tokens if tokens and macs else None,
            "drafter_mmacs_per_accepted": macs / 1e6 / accepted if accepted and macs else None,
            # the share of the drafter's accepted drafts made from states of an earlier round (hsd's reuse)
            "reused_share": reused / accepted if accepted and "reused_drafts" in rs[0] else None}


def accept_histogram(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[int, int]]:
    """Per method with speculative rounds: the histogram of tokens per round."""
    hist = {method: count_rounds(a for r in recs for turn in r["accept_lengths"] for a in turn)
            for method, recs in raw.items()}
    return {method: h for method, h in hist.items() if h}


# ------------------------------------------------------------------------------------------ the report


def write_report(out: Path, raw: dict[str, list[dict[str, Any]]], external: set[str],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """report.json, report.md and the plots of these raw records."""
    summary = summarize(raw, external, meta["temperature"] == 0)
    hist = accept_histogram(raw)
    report = {"meta": meta, "summary": summary, "accept_histogram": hist,
              "per_depth_acceptance": {m: per_depth_acceptance(h) for m, h in hist.items()}}
    report["plots"] = write_plots(out, summary, hist)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(summary, meta))
    return report


def _fmt(v: Any, spec: str = ".2f", suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:{spec}}{suffix}"


def _categories(summary: dict[str, Any]) -> list[str]:
    return sorted({c for m in summary.values() for c in m["by_category"] if c != "overall"}) + ["overall"]


def _label(method: str, m: dict[str, Any]) -> str:
    return f"{method} (external)" if m["external"] else method


def report_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# hsdjax bench: {meta['model']}", "",
             f"{meta['questions']} questions ({', '.join(meta['files'])}; {meta.get('selection', 'all')}), up to {meta['max_new_tokens']} new tokens "
             f"per turn, temperature {meta['temperature']}, {meta['started']}. Speed: Spec-Bench arithmetic (mean over "
             "questions of new tokens / wall time; speed-up = ratio of means vs `ar`; compile excluded).", "",
             f"Machine: {meta.get('machine', 'not recorded')}.", ""]
    cats = _categories(summary)
    lines += ["Speed-up over `ar` by category (Spec-Bench arithmetic):", "",
              "| method | " + " | ".join(cats) + " | identical to ar |", "|" + " --- |" * (len(cats) + 2)]
    for method, m in summary.items():
        cells = [_fmt((m["by_category"].get(c) or {}).get("speedup_vs_ar"), ".2f", "x") for c in cats]
        same = _fmt(m['by_category']['overall'].get('identical_to_ar'))
        if "identical_to_llamacpp" in m["by_category"]["overall"]:
            same += f" (to llamacpp: {_fmt(m['by_category']['overall']['identical_to_llamacpp'])})"
        lines.append(f"| {_label(method, m)} | " + " | ".join(cells) + f" | {same} |")
    lines += ["", "Per category:", ""]
    header = ("| method | category | questions | tokens/s | speed-up vs ar | mean accepted length | "
              "target passes / token | drafter passes (chain steps) / token | draft utilisation | "
              "drafter M multiply-adds / accepted draft | accepted drafts from earlier rounds' states | "
              "identical to ar |")
    lines += [header, "|" + " --- |" * 12]
    for cat in cats:
        for method, m in summary.items():
            row = m["by_category"].get(cat)
            if row:
                lines.append(_category_line(_label(method, m), cat, row))
    lines += _alone_table(summary)
    for note in meta.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def _alone_table(summary: dict[str, Any]) -> list[str]:
    """Decode alone (prefill excluded), the median question and each turn alone, against ``ar``."""
    turns = sorted({int(k.split("_")[1]) for m in summary.values() for k in m.get("alone", {})
                    if k.startswith("turn_")})
    if not any(m.get("alone") for m in summary.values()):
        return []
    lines = ["", "Decode alone (prefill excluded), the median of per-question speed-ups, and each turn alone "
             "(Spec-Bench arithmetic within the turn):", "",
             "| method | decode tokens/s | decode speed-up vs ar | median per-question speed-up | "
             + " | ".join(f"turn {t} speed-up" for t in turns) + " |", "|" + " --- |" * (4 + len(turns))]
    for method, m in summary.items():
        a = m.get("alone", {})
        lines.append(f"| {_label(method, m)} | {_fmt(a.get('decode_tokens_per_s'), '.1f')} | "
                     f"{_fmt(a.get('decode_speedup_vs_ar'), '.2f', 'x')} | {_fmt(a.get('median_ratio_vs_ar'), '.2f', 'x')} | "
                     + " | ".join(_fmt(a.get(f"turn_{t}_speedup_vs_ar"), ".2f", "x") for t in turns) + " |")
    return lines


def _category_line(name: str, cat: str, row: dict[str, Any]) -> str:
    return (f"| {name} | {cat} | {row['questions']} | {_fmt(row['tokens_per_s'], '.1f')} | "
            f"{_fmt(row['speedup_vs_ar'], '.2f', 'x')} | {_fmt(row['mean_accepted_length'])} | "
            f"{_fmt(row.get('target_passes_per_token'), '.3f')} | "
            f"{_fmt(row.get('draft_passes_per_token'), '.3f')} | "
            f"{_fmt(row.get('draft_utilisation'), '.3f')} | "
            f"{_fmt(row.get('drafter_mmacs_per_accepted'), '.2f')} | {_fmt(row.get('reused_share'), '.3f')} | "
            f"{_fmt(row.get('identical_to_ar'))} |")


def write_plots(out: Path, summary: dict[str, Any], hist: dict[str, dict[int, int]]) -> list[str]:
    """PNG plots; returns their file names (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(summary)}  # one colour per method everywhere
    written = [_plot_speedup(plt, out, summary, colors)]
    if hist:
        written.append(_plot_acceptance(plt, out, hist, colors))
    return written


def _plot_speedup(plt: Any, out: Path, summary: dict[str, Any], colors: dict[str, Any]) -> str:
    cats = _categories(summary)
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
    return "speedup_by_category.png"


def _plot_acceptance(plt: Any, out: Path, hist: dict[str, dict[int, int]], colors: dict[str, Any]) -> str:
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
    return "acceptance.png"
