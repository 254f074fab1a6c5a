"""The `hsdjax` command end to end on the real default model, and its answers to bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HSDJAX = [sys.executable, "-m", "hsdjax.frontends.cli"]


def run(*args, stdin=None, timeout=600):
    return subprocess.run([*HSDJAX, *args], capture_output=True, text=True, input=stdin, timeout=timeout,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_generate_json_end_to_end():
    proc = run("generate", "--prompt", "What is 2 + 2? Answer with one number.", "--max-new-tokens", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("text", "new_tokens", "prefill_s", "decode_s", "seconds", "tokens_per_s", "decode_tokens_per_s",
                "compile_s", "devices", "mesh"):
        assert key in stats, key
    assert 1 <= stats["new_tokens"] <= 24
    assert "4" in stats["text"]
    assert stats["seconds"] == pytest.approx(stats["prefill_s"] + stats["decode_s"], abs=1e-5)
    assert stats["tokens_per_s"] == pytest.approx(stats["new_tokens"] / stats["seconds"], rel=1e-3)


@pytest.mark.parametrize("args,needle", [
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model"),
    (["generate", "--prompt", "   "], "prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-5"], "at least 1"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "99999999"], "absurdly large"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--method", "nope"], "unknown method"),
    (["generate", "--prompt", "hi " * 9000, "--raw"], "context"),
    (["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"], "no such file"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--drafter", "/nonexistent/d.safetensors"], "not found"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--drafter", "README.md"], "not a drafter checkpoint"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--policy", "sometimes"], "--policy: must be one of"),
    (["generate", "--prompt", "hi", "--method", "pld", "--policy", "reuse"], "--policy, --ahead and --shortlist to hsd"),
    (["generate", "--prompt", "hi", "--method", "eagle", "--shortlist", "64"], "--shortlist applies to hsd only"),
    (["generate", "--prompt", "hi", "--method", "eagle", "--ahead", "1"], "--ahead applies to hsd only"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--ahead", "7"], "--ahead: must be between 0 and 4"),
    (["serve", "--prefill-chunk", "8"], "expected auto or a number of tokens"),
    (["serve", "--prefill-chunk", "lots"], "expected auto or a number of tokens"),
    (["serve", "--prefix-cache-mb", "-1"], "prefix-cache-mb"),
    (["generate", "--prompt", "hi", "--method", "sps", "--draft-length", "sometimes"], "draft"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--lookup", "-1"], "lookup"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--lookup", "65"], "--lookup: must be between 0 and 64"),
    (["generate", "--prompt", "hi", "--method", "eagle", "--lookup-ngram", "4"], "--lookup-ngram: must be between 1"),
    (["generate", "--prompt", "hi", "--method", "pld", "--lookup-lengths", "0,0"], "--lookup-lengths expects"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--lookup-lengths", "1,x"], "--lookup-lengths expects"),
    (["generate", "--prompt", "hi", "--method", "hsd", "--lookup-lengths", "0,1,3", "--lookup", "4"],
     "replaces --lookup"),
    (["generate", "--prompt", "hi", "--method", "pld", "--lookup-lengths", "0,3", "--depth", "4"], "not both"),
    (["tune", "--questions", "q.jsonl", "--method", "hsd", "--lookups", "3,x"], "whole number"),
    (["tune", "--questions", "q.jsonl", "--method", "hsd", "--lookups", "-1"], "lookups"),
    (["train-drafter", "/nonexistent/config.json"], "config not found"),
    (["train-drafter", "README.md"], "not JSON"),
])
def test_bad_input_is_one_clear_line(args, needle, capsys):
    """In process (``main`` is what the console script calls; a subprocess per case would spend most of
    its time importing JAX): exit status 2 and one line naming the problem, argparse's refusals too."""
    from hsdjax.frontends.cli import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err
    assert "Traceback" not in err


def _probe_values(option) -> list:
    if option.choices:
        return [*option.choices, "sometimes"]
    if option.kind == "int":
        return [option.lo - 1, option.lo, option.hi, option.hi + 1]
    return [-0.1, 0.0, 0.5, 1.0, 2.0]


def test_one_option_table_for_the_parser_and_make_drafter(capsys):
    """Every method option's values are defined once (``hsdjax.core.methods.OPTIONS``): the command line
    (generate, bench and serve share its flags) takes a value exactly when ``make_drafter`` (the Python
    API and the server's drafter) does, and both refuse it in the same words."""
    from hsdjax.core.methods import OPTIONS, check_options, make_drafter
    from hsdjax.errors import HsdjaxError
    from hsdjax.frontends.cli import build_parser

    parser = build_parser()
    checked = 0
    for option in OPTIONS:
        if option.kind == "text" and not option.choices:
            continue
        for value in _probe_values(option):
            try:
                parser.parse_args(["generate", "--prompt", "hi", option.flag, str(value)])
                cli_problem = None
            except SystemExit:
                cli_problem = capsys.readouterr().err.strip().splitlines()[-1]
            try:
                check_options({option.name: value})
                api_problem = None
            except HsdjaxError as exc:
                api_problem = str(exc)
                with pytest.raises(HsdjaxError) as made:  # before any model is needed
                    make_drafter("hsd", None, **{option.name: value})
                assert str(made.value) == api_problem
            assert (cli_problem is None) == (api_problem is None), (option.name, value, cli_problem, api_problem)
            if api_problem:  # "--ahead must be ..." / "argument --ahead: must be ..."
                assert cli_problem.endswith(f"argument {option.flag}: {api_problem[len(option.flag) + 1:]}")
            checked += 1
    assert checked >= 30


def test_bad_input_through_the_installed_command():
    """The same answer from a real process: status 2, one clear line, no traceback."""
    proc = run("generate", "--prompt", "hi", "--method", "hsd", "--drafter", "README.md")
    assert proc.returncode == 2
    assert "not a drafter checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_models_list_shows_registry():
    proc = run("models", "list")
    assert proc.returncode == 0
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in proc.stdout


@pytest.mark.slow  # a deep hsd tree on the real model (38 s); the tiny-model drafter tests cover the chain and reuse
def test_generate_hsd_json_reports_drafter_work():
    """The shipped hsd drafter of the default model: lossless against ar, and its counters."""
    prompt = "List three primary colors."
    ar = run("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json")
    # a tree deep enough for the chain and its reuse to run (the CPU's tuned default drafts one token)
    hsd = run("generate", "--prompt", prompt, "--max-new-tokens", "40", "--json", "--method", "hsd", "--depth", "4",
              "--budget", "5")
    assert ar.returncode == 0 and hsd.returncode == 0, hsd.stderr
    a, h = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (ar, hsd))
    assert h["text"] == a["text"]
    for key in ("drafter_states", "chain_steps", "reused_states", "draft_utilisation", "draft_passes",
                "reused_drafts", "reused_share"):
        assert key in h, key
    assert 0 <= h["reused_drafts"] <= h["accepted_drafts"] - h["lookup_drafts"]
    assert h["mean_accepted_length"] > 1.2  # the trained drafter is right often on a simple answer
    assert 0 < h["draft_utilisation"] <= 1


def test_demo_prints_the_answer_then_each_method_identical_to_ar():
    # what `make demo` runs, shortened: the ar answer, a speed line per method, and the equality checks
    proc = run("demo", "--max-new-tokens", "32", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    speeds = [line for line in lines if line.startswith("[")]
    assert [s.split(":")[0] for s in speeds] == ["[ar", "[pld", "[hsd"]
    assert lines.index(speeds[0]) > 0  # the answer comes first
    checks = [line for line in lines if " vs ar: " in line]
    assert [c.split()[0] for c in checks] == ["pld", "hsd"]
    assert all(c.endswith("greedy outputs identical: yes") for c in checks)
    assert "compiled ar in" in proc.stderr and "compiled hsd in" in proc.stderr
