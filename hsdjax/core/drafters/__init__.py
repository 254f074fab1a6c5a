"""Drafters: one module per method behind the small interface in ``base``, each built from explicit
arguments. Which method takes which options, their defaults, and building one for a loaded model
(checkpoints, draft models, tuned settings) live in ``hsdjax.core.methods``."""

from hsdjax.core.drafters.base import ARDrafter, Drafter
from hsdjax.core.drafters.eagle import EagleDrafter
from hsdjax.core.drafters.hsd import HSDDrafter
from hsdjax.core.drafters.pld import PromptLookupDrafter
from hsdjax.core.drafters.sps import DraftLMDrafter

__all__ = ["ARDrafter", "DraftLMDrafter", "Drafter", "EagleDrafter", "HSDDrafter", "PromptLookupDrafter"]
