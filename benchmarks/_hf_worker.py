"""Subprocess worker of ``benchmarks/ar_vs_transformers.py``: one transformers model, greedy ``generate`` on request.

    python benchmarks/_hf_worker.py MODEL --dtype bfloat16 --threads 2 --eos 2,0 [--assistant DRAFT | --prompt-lookup N]

MODEL is what hsdjax accepts (a registered name, a ``.gguf`` file, or a Hugging Face folder); a GGUF is
loaded with transformers' own GGUF reader, so the weights are the same dequantized values hsdjax uses.
The model is loaded in float32 and then cast to ``--dtype``. It then speaks JSON lines:

* once loaded it writes ``{"ready": true, "load_s": ..., "torch": ..., "transformers": ...}``;
* for each request line ``{"ids": [...], "max_new_tokens": N}`` it runs one greedy generate (batch 1,
  KV cache, stopping at the ``--eos`` ids) and answers ``{"tokens": [...], "prefill_s": s, "total_s": s}``:
  the new token ids, the seconds until the first new token reached a streamer (prompt forward + first
  selection, inside the same call), and the seconds of the whole call;
* it exits at the end of its input.

Answers go to the process's original stdout; anything a library prints is sent to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO


def _protocol_channel() -> TextIO:
    """Keep the real stdout for answers; point fd 1 and sys.stdout at stderr for everything else."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def load(name: str, dtype: str, threads: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from hsdjax import registry

    torch.set_num_threads(threads)
    source = registry.resolve(name, check=False)  # the parent has already resolved (and verified) it
    if source.kind == "gguf":
        folder, kwargs = source.path.parent, {"gguf_file": source.path.name}
    else:
        folder, kwargs = source.path, {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
    return model.to(getattr(torch, dtype)).eval()


class _Stamps:
    """A streamer that only notes when each ``put`` happens (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate(model: Any, ids: list[int], max_new_tokens: int, eos: list[int], **extra: Any) -> dict[str, Any]:
    import torch

    prompt = torch.tensor([ids])
    stamps = _Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], use_cache=True,
                             streamer=None if extra else stamps, **extra)
    total_s = time.perf_counter() - t0
    # transformers refuses a streamer with assisted / prompt-lookup decoding: no prefill split there
    prefill_s = stamps.times[1] - t0 if len(stamps.times) > 1 else 0.0
    return {"tokens": out[0, len(ids):].tolist(), "prefill_s": prefill_s, "total_s": total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--eos", required=True, help="comma-separated stop token ids")
    parser.add_argument("--assistant", default=None, help="assisted generation with this draft model")
    parser.add_argument("--prompt-lookup", type=int, default=0, help="prompt lookup decoding: tokens per guess")
    args = parser.parse_args()
    eos = [int(i) for i in args.eos.split(",")]
    channel = _protocol_channel()

    t0 = time.perf_counter()
    model = load(args.model, args.dtype, args.threads)
    extra: dict[str, Any] = {}
    if args.assistant:
        extra["assistant_model"] = load(args.assistant, args.dtype, args.threads)
    if args.prompt_lookup:
        extra["prompt_lookup_num_tokens"] = args.prompt_lookup
    import torch
    import transformers

    info = {"ready": True, "load_s": time.perf_counter() - t0, "dtype": args.dtype, "threads": args.threads,
            "torch": torch.__version__, "transformers": transformers.__version__}
    channel.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        answer = generate(model, request["ids"], request["max_new_tokens"], eos, **extra)
        channel.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
