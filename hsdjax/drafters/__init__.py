"""Drafters: one module per method behind the small interface in ``base``, each built from explicit
arguments. Which method takes which options, their defaults, and building one for a loaded model
(checkpoints, draft models, tuned settings) live in ``hsdjax.methods``."""

from hsdjax.drafters.base import ARDrafter, Drafter
from hsdjax.drafters.eagle import EagleDrafter
from hsdjax.drafters.hsd import HSDDrafter
from hsdjax.drafters.pld import PromptLookupDrafter
from hsdjax.drafters.sps import DraftLMDrafter

__all__ = ["ARDrafter", "DraftLMDrafter", "Drafter", "EagleDrafter", "HSDDrafter", "PromptLookupDrafter"]
