"""Drafters: one module per method behind the small interface in ``base``; ``make_drafter`` builds one."""

from __future__ import annotations

from typing import Any

from hsdjax.drafters.base import ARDrafter, Drafter
from hsdjax.errors import HsdjaxError

METHODS = ("ar", "pld", "sps")
DEFAULTS = {
    "pld": {"width": 2, "depth": 6},
    "sps": {"depth": 4},
}


def make_drafter(method: str, model: Any, *, draft_model: str | None = None, depth: int | None = None,
                 width: int | None = None) -> tuple[Drafter, Any]:
    """The drafter for ``method`` on a loaded target, and its params (a pytree; () when none)."""
    if method not in METHODS:
        raise HsdjaxError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    opts = dict(DEFAULTS.get(method, {}))
    if depth is None and width is None and method in DEFAULTS:  # a setting written by `hsdjax tune`
        from hsdjax.tune import load_tuned

        opts.update(load_tuned(model.fingerprint, method))
    for key, value in (("depth", depth), ("width", width)):
        if value is not None:
            if value < 1 or value > 64:
                raise HsdjaxError(f"--{key} must be between 1 and 64 (got {value})")
            opts[key] = value
    if method == "ar":
        return ARDrafter(), ()
    if method == "pld":
        from hsdjax.drafters.pld import PromptLookupDrafter

        return PromptLookupDrafter(**opts), ()
    from hsdjax.api import load_model
    from hsdjax.drafters.sps import DraftLMDrafter, check_draft_compatible

    opts.pop("width", None)
    name = draft_model or (model.source.spec.draft_model if model.source.spec else None)
    if not name:
        raise HsdjaxError(f"sps needs a draft model of {model.name}'s tokenizer; pass --draft-model NAME "
                          "(e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    draft = load_model(name, dtype=model.cfg.dtype, layer_loop="scan" if model.cfg.scan_layers else "unrolled")
    check_draft_compatible(model, draft)
    return DraftLMDrafter(draft_cfg=draft.cfg, **opts), draft.params
