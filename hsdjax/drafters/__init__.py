"""Drafters: one module per method behind the small interface in ``base``; ``make_drafter`` builds one."""

from __future__ import annotations

from typing import Any

from hsdjax.drafters.base import ARDrafter, Drafter
from hsdjax.errors import HsdjaxError

METHODS = ("ar", "pld", "sps", "hsd", "eagle")
DEFAULTS = {
    "pld": {"width": 2, "depth": 6},
    "sps": {"depth": 4},
    # measured on SmolLM2 / 2-core CPU (benchmarks/feature_drafters.py): min2 was the fastest policy
    "hsd": {"depth": 4, "width": 3, "budget": 5, "policy": "min2"},
    "eagle": {"depth": 4, "width": 3, "budget": 5},
}
FEATURE_METHODS = ("hsd", "eagle")


def draft_model_of(model: Any, explicit: str | None = None) -> str | None:
    """The draft LM for ``sps`` / assisted generation: the one asked for, else the registry's, else None."""
    return explicit or (model.source.spec.draft_model if model.source.spec else None)


def has_shipped_drafter(model_name: str, method: str) -> bool:
    """Whether a trained ``hsd`` / ``eagle`` drafter ships for this model."""
    from hsdjax.drafters.checkpoint import shipped_path

    return shipped_path(model_name, method).is_file()


def make_drafter(method: str, model: Any, *, draft_model: str | None = None, depth: int | None = None,
                 width: int | None = None, budget: int | None = None, policy: str | None = None,
                 drafter: str | None = None, min_prob: float | None = None) -> tuple[Drafter, Any]:
    """The drafter for ``method`` on a loaded target, and its params (a pytree; () when none)."""
    if method not in METHODS:
        raise HsdjaxError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    opts = dict(DEFAULTS.get(method, {}))
    if depth is None and width is None and budget is None and method in DEFAULTS:  # written by `hsdjax tune`
        from hsdjax.tune import load_tuned

        opts.update(load_tuned(model.fingerprint, method))
    for key, value in (("depth", depth), ("width", width), ("budget", budget)):
        if value is not None:
            if value < 1 or value > 64:
                raise HsdjaxError(f"--{key} must be between 1 and 64 (got {value})")
            opts[key] = value
    if method in FEATURE_METHODS:
        return _feature_drafter(method, model, opts, drafter, policy, min_prob)
    if drafter is not None or policy is not None:
        raise HsdjaxError(f"--drafter and --policy apply to hsd and eagle, not {method}")
    if method == "ar":
        return ARDrafter(), ()
    opts.pop("budget", None)
    if method == "pld":
        from hsdjax.drafters.pld import PromptLookupDrafter

        return PromptLookupDrafter(**opts), ()
    from hsdjax.api import load_model
    from hsdjax.drafters.sps import DraftLMDrafter, check_draft_compatible

    opts.pop("width", None)
    name = draft_model_of(model, draft_model)
    if not name:
        raise HsdjaxError(f"sps needs a draft model of {model.name}'s tokenizer; pass --draft-model NAME "
                          "(e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    draft = load_model(name, dtype=model.cfg.dtype, layer_loop="scan" if model.cfg.scan_layers else "unrolled")
    check_draft_compatible(model, draft)
    return DraftLMDrafter(draft_cfg=draft.cfg, **opts), draft.params


def _feature_drafter(method: str, model: Any, opts: dict[str, Any], path: str | None, policy: str | None,
                     min_prob: float | None) -> tuple[Drafter, Any]:
    """`hsd` / `eagle`: a trained checkpoint (the shipped one of a known model unless ``path``)."""
    from hsdjax.drafters.checkpoint import load_drafter, shipped_path

    if path is None:
        shipped = shipped_path(model.name, method)
        if not has_shipped_drafter(model.name, method):
            raise HsdjaxError(f"no shipped {method} drafter for {model.name}; train one with "
                              f"`hsdjax train-drafter CONFIG` and pass --drafter PATH")
        path = str(shipped)
    cfg, layers, dparams, _ = load_drafter(path, model, method)
    if opts["budget"] > opts["depth"] * opts["width"]:
        opts["budget"] = opts["depth"] * opts["width"]
    if min_prob is not None:
        if not 0 <= min_prob < 1:
            raise HsdjaxError(f"--min-prob must be in [0, 1) (got {min_prob})")
        opts["min_prob"] = min_prob
    if method == "hsd":
        from hsdjax.drafters.hsd import POLICIES, HSDDrafter

        if policy is not None:
            if policy not in POLICIES:
                raise HsdjaxError(f"unknown --policy {policy!r}; available: {', '.join(POLICIES)}")
            opts["policy"] = policy
        return HSDDrafter(cfg=cfg, layers=layers, **opts), dparams
    from hsdjax.drafters.eagle import EagleDrafter

    if policy is not None:
        raise HsdjaxError("--policy applies to hsd only")
    opts.pop("policy", None)
    return EagleDrafter(cfg=cfg, layers=layers, **opts), dparams
