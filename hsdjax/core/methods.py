"""The method registry: every decoding method, the options that reach its drafter (with their defaults
and help text, which the command line, ``bench``, ``tune`` and the server read from here), the tree
setting ``hsdjax tune --write`` stored for this device, and ``make_drafter``, which builds a method's
drafter for a loaded target (loading the draft model of ``sps``).

The drafter classes (``hsdjax.core.drafters``) know nothing of this: they are built from explicit arguments.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from pathlib import Path
from typing import Any, Mapping

import jax

from hsdjax.core.drafters import ARDrafter, Drafter, DraftLMDrafter, EagleDrafter, HSDDrafter, PromptLookupDrafter
from hsdjax.core.drafters.checkpoint import load_drafter, shipped_path
from hsdjax.core.drafters.hsd import POLICIES
from hsdjax.core.drafters.pld import FIXED_MAX_NGRAM, TABLE_MAX_NGRAM
from hsdjax.core.drafters.sps import DRAFT_LENGTHS, check_draft_compatible
from hsdjax.errors import HsdjaxError
from hsdjax.paths import cache_dir
from hsdjax.runtime.loading import load_model


@dataclasses.dataclass(frozen=True)
class Option:
    """A method option: a keyword of ``make_drafter`` and a ``--flag`` of the command line, with the one
    definition of the values it takes, which the argument parser (``hsdjax.frontends.cli``, also for ``hsdjax
    serve``) and ``make_drafter`` (``check_options``; the Python API and the server's scheduler) both read."""

    name: str
    kind: str  # "int", "prob" (a float in [lo, hi)) or "text"
    help: str
    lo: float | None = None  # "int": [lo, hi]; "prob": [lo, hi)
    hi: float | None = None
    choices: tuple[str, ...] = ()  # "text" with a closed set of values

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this option (a phrase after the flag), or None."""
        if self.choices:
            return None if value in self.choices else f"must be one of {', '.join(self.choices)} (got {value!r})"
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy integers too
                return f"must be a whole number (got {value!r})"
            return None if self.lo <= value <= self.hi else f"must be between {self.lo} and {self.hi} (got {value})"
        if self.kind == "prob":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                return f"must be a number (got {value!r})"
            return None if self.lo <= value < self.hi else f"must be in [{self.lo}, {self.hi}) (got {value})"
        return None


MAX_TREE = 64  # the largest tree size, lookup chain and depth any option asks for
OPTIONS = (  # in the order of the command line's --help
    Option("drafter", "text", "hsd/eagle: a drafter checkpoint (default: the one shipped for --model)"),
    Option("budget", "int", "hsd/eagle: tree nodes verified per round besides the root", 1, MAX_TREE),
    Option("policy", "text", f"hsd: chain refresh policy: {', '.join(POLICIES)}", choices=POLICIES),
    Option("ahead", "int", "hsd: chain states drafted beyond the tree's depth and kept for later rounds "
                           "(0-4, default 0)", 0, 4),
    Option("shortlist", "int", "hsd: score a chain state's children only among the N likeliest tokens of its "
                               "token-free logits (one head per depth; 0: the whole draft vocabulary, default)",
           0, 1 << 20),
    Option("min_prob", "prob", "hsd/eagle: drop draft nodes below this probability (a smaller tree is verified)",
           0, 1),
    Option("grow_prob", "prob", "hsd/eagle: verify nodes beyond the most likely draft only when their cumulative "
                                "draft probability reaches this (the tree grows where the drafter is sure)", 0, 1),
    Option("lookup", "int", "hsd/eagle: also verify prompt lookup's continuation of up to this many tokens "
                            "when the context has a match (0: off; default 6)", 0, MAX_TREE),
    Option("lookup_ngram", "int", f"hsd/eagle: shortest match (1-{FIXED_MAX_NGRAM} newest tokens, default 2) that "
                                  "grafts a lookup continuation", 1, FIXED_MAX_NGRAM),
    Option("lookup_lengths", "text", "pld/hsd/eagle: lookup chain length by match length, e.g. 0,1,1,3: a match of "
                                     "the 1, 2, 3, 4 newest tokens proposes 0, 1, 1, 3 tokens (replaces --lookup and "
                                     "--lookup-ngram, and pld's --depth)"),
    Option("draft_model", "text", "sps: the draft LM (default: the registry's draft model for --model)"),
    Option("draft_length", "text", "sps: adaptive (default: per row, from its recent acceptance, at most --depth; "
                                   "as transformers' assisted generation) or fixed (--depth drafts every round)",
           choices=DRAFT_LENGTHS),
    Option("depth", "int", "speculative: draft depth (tokens per guess)", 1, MAX_TREE),
    Option("width", "int", "pld: candidate continuations per round; hsd/eagle: tree width", 1, MAX_TREE),
)
OPTION_BY_NAME = {o.name: o for o in OPTIONS}


def options_from_args(args: Any) -> dict[str, Any]:
    """The method options given on a command line (an ``argparse.Namespace`` of ``hsdjax generate``,
    ``bench`` or ``serve``): the one place they are collected."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if getattr(args, o.name, None) is not None}


def check_options(given: Mapping[str, Any]) -> None:
    """Refuse the first given option whose value its ``Option`` does not take (one clear line)."""
    for name, value in given.items():
        problem = OPTION_BY_NAME[name].problem(value) if name in OPTION_BY_NAME else None
        if problem:
            raise HsdjaxError(f"{OPTION_BY_NAME[name].flag} {problem}")


OPTION_NAMES = tuple(o.name for o in OPTIONS)
TREE_SIZES = ("depth", "width", "budget")  # the tree's shape options
TUNED_KEYS = (*TREE_SIZES, "lookup")  # what `hsdjax tune` chooses (lookup: hsd / eagle's grafted continuation)


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method: the options that reach its drafter, and their defaults."""

    name: str
    options: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


REGISTRY = {m.name: m for m in (
    Method("ar"),
    Method("pld", ("depth", "width", "lookup_lengths"), {"width": 2, "depth": 6}),
    # measured on Qwen2.5-Coder-1.5B / 2-core CPU (experiments/notes/benchmarks-log.md): adaptive up to 8
    # drafts 1.20x ar, fixed 4 1.11x, fixed 8 1.14x
    Method("sps", ("depth", "draft_model", "draft_length"), {"depth": 8}),
    # measured on SmolLM2 / 2-core CPU (benchmarks/feature_drafters.py): min2 was the fastest policy; a grafted
    # lookup continuation of 6 tokens on 2-token matches took hsd from 1.10x to 1.62x ar on the dev sets
    # (1-token matches 1.53x, 3-token 1.62x, 4 tokens on 2-token matches 1.54x; experiments/notes/drafters-log.md)
    Method("hsd", ("depth", "width", "budget", "policy", "ahead", "shortlist", "drafter", "min_prob", "grow_prob",
                   "lookup",
                   "lookup_ngram", "lookup_lengths"),
           {"depth": 4, "width": 3, "budget": 5, "policy": "min2", "ahead": 0, "lookup": 6, "lookup_ngram": 2}),
    Method("eagle", ("depth", "width", "budget", "drafter", "min_prob", "grow_prob", "lookup", "lookup_ngram",
                     "lookup_lengths"),
           {"depth": 4, "width": 3, "budget": 5, "lookup": 6, "lookup_ngram": 2}),
)}
METHODS = tuple(REGISTRY)
DEFAULTS = {m.name: dict(m.defaults) for m in REGISTRY.values() if m.defaults}
FEATURE_METHODS = ("hsd", "eagle")  # trained drafters reading the target's hidden states
TREE_METHODS = tuple(m for m in METHODS if "depth" in REGISTRY[m].options)  # the methods `hsdjax tune` sizes


def options_for(method: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options among ``options`` that reach ``method`` (``policy`` only reaches hsd, and so on)."""
    return {k: v for k, v in options.items() if k in REGISTRY[method].options}


# ------------------------------------------------------------------------------------ tuned settings


SHIPPED_TUNED = Path(__file__).parent / "drafters" / "checkpoints" / "tuned.json"


def device_kinds(model: Any = None) -> tuple[str, ...]:
    """The kinds of device a tree setting is measured for, most specific first: through hsdjax's CPU
    kernels, the JAX backend and the instruction set they were built for ("cpu:avx2", "cpu:avx512",
    "cpu:neon": a verified node costs ~0.5 of a step with 8 float32 lanes, ~0.3 with 16), then the JAX
    backend alone ("cpu", "gpu", "tpu"), which also stands for XLA's path on a CPU."""
    backend = jax.default_backend()
    isa = (getattr(model, "backend", None) or {}).get("isa", "") if model is not None else ""
    family = isa.split(" ")[0]
    return (f"{backend}:{family}", backend) if family else (backend,)


def shipped_tuned(model_name: str, method: str, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The tree sizes measured by `hsdjax tune` for a registered model's shipped drafter (or a method
    without one) on this kind of device (the first of ``kinds``, default ``device_kinds()``, that has
    an entry), as they ship in ``drafters/checkpoints/tuned.json``; {} when none were measured."""
    try:
        per_kind = json.loads(SHIPPED_TUNED.read_text())[model_name][method]
        entry = next(per_kind[k] for k in (kinds or device_kinds()) if k in per_kind)
        tuned: dict[str, Any] = {k: int(entry[k]) for k in TUNED_KEYS if k in entry}
        if "lookup_lengths" in entry:
            tuned["lookup_lengths"] = parse_lookup_lengths(entry["lookup_lengths"])
        return tuned
    except (OSError, ValueError, KeyError, TypeError, StopIteration, HsdjaxError):
        return {}


def parse_lookup_lengths(value: Any) -> tuple[int, ...]:
    """``--lookup-lengths`` ("0,1,1,3" or a sequence of counts) as a tuple, checked."""
    text = value if isinstance(value, str) else ",".join(str(v) for v in value)
    try:
        lengths = tuple(int(v) for v in text.split(","))
    except ValueError:
        lengths = ()
    if (not lengths or len(lengths) > TABLE_MAX_NGRAM or min(lengths) < 0 or max(lengths) < 1
            or max(lengths) > MAX_TREE):
        raise HsdjaxError(f"--lookup-lengths expects 1-{TABLE_MAX_NGRAM} comma-separated chain lengths (0-{MAX_TREE}, at "
                          f"least one above 0) for matches of 1, 2, ... tokens, e.g. 0,1,1,3 (got {text!r})")
    return lengths


def tuned_path(fingerprint: str, method: str, kind: str | None = None) -> Path:
    """Where ``hsdjax tune --write`` keeps a model's setting for a method on a kind of device
    (``device_kinds``; default: the JAX backend)."""
    kind = (kind or jax.default_backend()).replace(":", "-")
    return cache_dir("tuned") / f"{fingerprint[:16]}-{method}-{kind}.json"


def load_tuned(fingerprint: str, method: str, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The stored tree sizes (and ``min_prob`` when they were measured with one) for the most specific
    of ``kinds`` (default ``device_kinds()``) that has one; {} when none."""
    for kind in kinds or device_kinds():
        try:
            data = json.loads(tuned_path(fingerprint, method, kind).read_text())
        except (OSError, ValueError):
            continue
        try:
            tuned: dict[str, Any] = {k: int(data[k]) for k in TUNED_KEYS if k in data}
            if data.get("min_prob") is not None:
                tuned["min_prob"] = float(data["min_prob"])
            return tuned
        except (ValueError, KeyError, TypeError):
            return {}
    return {}


def write_tuned(fingerprint: str, method: str, best: dict[str, Any], min_prob: float | None = None,
                kind: str | None = None) -> Path:
    """Store ``best``'s tree sizes that ``method`` uses (with the ``min_prob`` they were measured with)
    for a kind of device (``device_kinds``; default: the JAX backend)."""
    setting = {k: best[k] for k in TUNED_KEYS if k in REGISTRY[method].defaults and k in best}
    if method in FEATURE_METHODS and min_prob:
        setting["min_prob"] = min_prob
    path = tuned_path(fingerprint, method, kind)
    path.write_text(json.dumps(setting | {"source": "hsdjax tune", "device": kind or jax.default_backend(),
                                          "expected": best}, indent=2))
    return path


# ------------------------------------------------------------------------------------ drafters


def draft_model_of(model: Any, explicit: str | None = None) -> str | None:
    """The draft LM for ``sps`` / assisted generation: the one asked for, else the registry's, else None."""
    return explicit or (model.source.spec.draft_model if model.source.spec else None)


def has_shipped_drafter(model_name: str, method: str) -> bool:
    """Whether a trained ``hsd`` / ``eagle`` drafter ships for this model."""
    return shipped_path(model_name, method).is_file()


def make_drafter(method: str, model: Any, **options: Any) -> tuple[Drafter, Any]:
    """The drafter for ``method`` on a loaded target, and its params (a pytree; () when none).

    ``options`` are ``OPTIONS`` keywords (None: not given). Without an explicit tree size the tuned
    setting applies, else the method's defaults. Options a method does not use are ignored, except
    ``drafter`` and ``policy`` outside hsd / eagle."""
    if method not in REGISTRY:
        raise HsdjaxError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    unknown = [k for k in options if k not in OPTION_NAMES]
    if unknown:
        raise TypeError(f"make_drafter() got unknown options {unknown}; known: {', '.join(OPTION_NAMES)}")
    given = {k: v for k, v in options.items() if v is not None}
    check_options(given)
    setting = tree_setting(method, model, given)
    if method in FEATURE_METHODS:
        return _feature(method, model, setting, given)
    if "drafter" in given or "policy" in given or "ahead" in given or "shortlist" in given:
        raise HsdjaxError(f"--drafter applies to hsd and eagle, --policy, --ahead and --shortlist to hsd; "
                          f"not to {method}")
    if method == "ar":
        return ARDrafter(), ()
    if method == "pld":
        lengths = parse_lookup_lengths(given["lookup_lengths"]) if "lookup_lengths" in given else ()
        if lengths and "depth" in given:
            raise HsdjaxError("pld takes --depth or --lookup-lengths, not both")
        return PromptLookupDrafter(width=setting["width"], depth=setting["depth"],
                                   lengths=lengths or tuple(setting.get("lookup_lengths", ()))), ()
    return _sps(model, setting["depth"], given.get("draft_model"), given.get("draft_length", "adaptive"))


def tree_setting(method: str, model: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """The method's defaults; when no tree size is given, the setting shipped for the model's own
    drafter on this kind of device (not for a ``drafter`` checkpoint given explicitly), then this
    machine's own ``hsdjax tune --write`` setting (tree sizes and, for hsd / eagle, the lookup length,
    which an explicit ``lookup`` still overrides); then the sizes given."""
    setting = dict(REGISTRY[method].defaults)
    sizes = {k: given[k] for k in TREE_SIZES if k in given}
    if not sizes and setting:
        kinds = device_kinds(model)
        if "drafter" not in given:
            setting.update(shipped_tuned(model.name, method, kinds))
        own = load_tuned(model.fingerprint, method, kinds)
        if own:  # this machine's measured setting (its graft, pld's depth) replaces the shipped table
            setting.pop("lookup_lengths", None)
        setting.update(own)
    return setting | sizes


def _sps(model: Any, depth: int, draft_model: str | None, draft_length: str = "adaptive") -> tuple[Drafter, Any]:
    """``sps``: a draft LM of the target's tokenizer, in the target's dtype and layer loop."""
    name = draft_model_of(model, draft_model)
    if not name:
        raise HsdjaxError(f"sps needs a draft model of {model.name}'s tokenizer; pass --draft-model NAME "
                          "(e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    draft = load_model(name, dtype=model.cfg.dtype, layer_loop="scan" if model.cfg.scan_layers else "unrolled")
    check_draft_compatible(model, draft)
    return DraftLMDrafter(draft_cfg=draft.cfg, depth=depth, draft_length=draft_length), draft.params


def _feature(method: str, model: Any, setting: dict[str, Any], given: Mapping[str, Any]) -> tuple[Drafter, Any]:
    """``hsd`` / ``eagle``: a trained checkpoint (the shipped one of a known model unless ``drafter``)."""
    path = given.get("drafter")
    if path is None:
        if not has_shipped_drafter(model.name, method):
            raise HsdjaxError(f"no shipped {method} drafter for {model.name}; train one with "
                              f"`hsdjax train-drafter CONFIG` and pass --drafter PATH")
        path = str(shipped_path(model.name, method))
    if given.get("shortlist") and method != "hsd":
        raise HsdjaxError("--shortlist applies to hsd only")
    cfg, layers, dparams, _ = load_drafter(path, model, method, head_rows=bool(given.get("shortlist")))
    for name in ("min_prob", "grow_prob", "lookup", "lookup_ngram"):  # checked by ``check_options``
        if name in given:
            setting[name] = given[name]
    if "lookup_lengths" in given:
        if "lookup" in given or "lookup_ngram" in given:
            raise HsdjaxError("--lookup-lengths replaces --lookup and --lookup-ngram; give one or the other")
        setting["lookup_lengths"] = parse_lookup_lengths(given["lookup_lengths"])
    elif "lookup" in given or "lookup_ngram" in given:
        setting.pop("lookup_lengths", None)  # an explicit fixed graft replaces a tuned table
    if "policy" in given:
        if method != "hsd":
            raise HsdjaxError("--policy applies to hsd only")
        setting["policy"] = given["policy"]
    if "ahead" in given:
        if method != "hsd":
            raise HsdjaxError("--ahead applies to hsd only")
        setting["ahead"] = given["ahead"]
    if given.get("shortlist"):
        setting["shortlist"] = given["shortlist"]
    return feature_drafter(method, cfg, layers, backend=model.cfg.backend, **setting), dparams


def feature_drafter(method: str, cfg: Any, layers: tuple[int, ...], **setting: Any) -> Drafter:
    """An ``hsd`` / ``eagle`` drafter of network config ``cfg`` over the fused target ``layers``, with
    ``setting`` (depth, width, budget, hsd's policy, min_prob, lookup, the target's ``backend``); the budget
    is capped at depth x width."""
    setting["budget"] = min(setting["budget"], setting["depth"] * setting["width"])
    if method == "hsd":
        return HSDDrafter(cfg=cfg, layers=layers, **setting)
    setting.pop("policy", None)
    setting.pop("ahead", None)
    setting.pop("shortlist", None)
    return EagleDrafter(cfg=cfg, layers=layers, **setting)
