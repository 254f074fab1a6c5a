"""Running the methods: our decoding methods and the external peers (``hsdjax.frontends.peers``) behind one
``turn`` call, which ones can run here, warming them up before timing, and the interleaving (every
question runs each method in a rotating order, so machine drift hits every method alike).

Shared by ``hsdjax bench`` and the scripts in ``benchmarks/``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from hsdjax.core.methods import FEATURE_METHODS, draft_model_of, has_shipped_drafter, options_for
from hsdjax.frontends.api import Generator
from hsdjax.frontends.bench.questions import Messages, Question, converse
from hsdjax.frontends.peers import PEERS, peer_available, start_peers

T = TypeVar("T")
Prompt = Messages | list[int]  # chat messages or token ids


@dataclasses.dataclass
class Turn:
    """One method's answer to one prompt, with its timing and the engine's counters."""

    text: str
    tokens: list[int]
    wall_time: float  # prefill + decode seconds
    accept_lengths: list[int]
    target_passes: int = 0
    draft_passes: int = 0  # drafter forward passes
    drafter_states: int = 0
    accepted_drafts: int = 0
    lookup_drafts: int = 0  # of those, supplied by a grafted prompt-lookup chain
    drafter_macs: float = 0.0
    decode_s: float = 0.0  # after the first new token (which comes out of the prefill)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # a local method's full counters


class LocalMethod:
    """One hsdjax method on the loaded model."""

    external = False

    def __init__(self, gen: Any):
        self.gen, self.name = gen, gen.method

    def settings(self) -> dict[str, Any]:
        """The drafter's effective options (tuned defaults included): what a resume must match."""
        d = self.gen.drafter
        fields = vars(d) if hasattr(d, "__dict__") else {}
        return {k: v for k, v in sorted(fields.items()) if isinstance(v, (bool, int, float, str, type(None)))}

    def turn(self, prompt: Prompt, max_new: int, temperature: float = 0.0, seed: int = 0) -> Turn:
        r = self.gen.generate(prompt, max_new_tokens=max_new, temperature=temperature, seed=seed)[0]
        s = r.stats
        return Turn(r.text, r.tokens, r.seconds, s["accept_lengths"], s["target_passes"], s["draft_passes"],
                    s.get("drafter_states", 0), s.get("accepted_drafts", 0), s.get("lookup_drafts", 0),
                    s.get("drafter_macs", 0.0), r.decode_s, s)


class PeerMethod:
    """An external engine (``hsdjax.frontends.peers``) fed the same token ids; it decodes greedily."""

    external = True

    def __init__(self, peer: Any, tokenizer: Any):
        self.peer, self.name, self.tokenizer = peer, peer.name, tokenizer

    def settings(self) -> dict[str, Any]:
        return {"dtype": self.peer.dtype}

    def turn(self, prompt: Prompt, max_new: int, temperature: float = 0.0, seed: int = 0) -> Turn:
        ids = prompt if prompt and isinstance(prompt[0], int) else self.tokenizer.encode_chat(prompt)
        a = self.peer.generate(ids, max_new)
        toks = a["tokens"]
        stops = set(self.tokenizer.stop_ids)
        text = self.tokenizer.decode([t for t in toks if t not in stops], skip_special_tokens=True)
        return Turn(text, toks, a["total_s"], [], decode_s=a["total_s"] - a["prefill_s"])


def answer_question(method: Any, q: Question, max_new: int, temperature: float, seed: int) -> list[Turn]:
    """Every turn of ``q``, each prompt holding the method's own answers to the earlier turns."""
    _, turns = converse(q.turns, lambda messages, i: method.turn(messages, max_new, temperature,
                                                                  seed + 1000 * q.question_id + i))
    return turns


def make_runners(model: Any, methods: list[str], options: dict[str, Any], temperature: float, peer_dtype: str,
                 notes: list[str]) -> tuple[list[Any], list[Any]]:
    """Local methods and peers (over shared worker processes) that can run here; the rest are noted."""
    draft = draft_model_of(model, options.get("draft_model"))
    runners: list[Any] = []
    peer_names = []
    for m in methods:
        why = _why_not(m, model.name, options, temperature, draft)
        if why:
            notes.append(why)
        elif m in PEERS:
            peer_names.append(m)
        else:
            runners.append(LocalMethod(Generator(model, m, **options_for(m, options))))
    peers, workers = start_peers(peer_names, model.name, model.tokenizer.stop_ids, dtype=peer_dtype, draft=draft)
    if peer_dtype != "float32" and any(PEERS[m][0] == "hf" for m in peer_names):
        notes.append(f"transformers peers ran in {peer_dtype} (hsdjax: {model.cfg.dtype})")
    if "llamacpp-pld" in peers:
        notes.append("llamacpp-pld is llama.cpp's own prompt-lookup decoding; its greedy tokens are checked "
                     "against llamacpp's plain decoding where both ran (identical_to_llamacpp)")
    if "llamacpp" in peers:
        notes.append("llamacpp runs the GGUF's quantized kernels (weights as shipped, activations quantized "
                     "on the fly), not float32 on the dequantized weights, so its greedy tokens may differ from ar")
    return runners + [PeerMethod(peers[m], model.tokenizer) for m in peer_names], workers


def _why_not(method: str, model_name: str, options: dict[str, Any], temperature: float,
             draft: str | None) -> str | None:
    """Why ``method`` cannot run here (one line), or None."""
    if method in PEERS:
        why = peer_available(method)
        if why is None and method == "hf-assisted" and not draft:
            why = f"{method} skipped: {model_name} has no draft model of its tokenizer"
        if why is None and temperature > 0:
            why = f"{method} skipped: peers decode greedily only (temperature {temperature} asked)"
        return why
    if method == "sps" and not draft:
        return f"sps skipped: {model_name} has no draft model of its tokenizer"
    if method in FEATURE_METHODS and not options.get("drafter") and not has_shipped_drafter(model_name, method):
        return f"{method} skipped: no {method} drafter for {model_name} (train one with `hsdjax train-drafter`)"
    return None


def rotations(items: Iterable[T], runners: Sequence[Any]) -> Iterator[tuple[T, list[Any]]]:
    """Each item with the order to run the runners in: rotated by one per item."""
    for i, item in enumerate(items):
        k = i % len(runners) if runners else 0
        yield item, [*runners[k:], *runners[:k]]


def warm_up(runners: Iterable[Any], run: Callable[[Any], Any]) -> None:
    """Before timing: peers start loading in the background while ``run(runner)`` compiles each local
    method for the shapes to come; then every peer is waited for and run once too."""
    runners = list(runners)
    for r in runners:
        if isinstance(r, PeerMethod):
            r.peer.worker.start()
    for r in runners:
        if isinstance(r, PeerMethod):
            r.peer.wait_ready()
        run(r)
