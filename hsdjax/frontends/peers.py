"""External peers measured side by side with hsdjax: transformers and llama.cpp, each in a subprocess.

A worker is a long-lived process (``python -m hsdjax.frontends.peers KIND MODEL ...``) speaking JSON lines,
so its memory stays bounded and its thread pool does not compete with XLA's inside one process:

* once loaded it writes ``{"ready": true, "load_s": ...}``;
* for each request ``{"ids": [...], "max_new_tokens": N, "mode": M}`` it generates greedily (batch 1,
  stopping at the ``--eos`` ids) and answers ``{"tokens": [...], "prefill_s": s, "total_s": s}``
  (``prefill_s`` is the time to the first new token where the peer can report it, else 0), or
  ``{"error": "..."}``.

Kinds and their modes: ``hf`` -- transformers ``generate``: ``plain`` (peer ``hf-ar``), ``lookup``
(``hf-pld``, prompt lookup decoding) and, when started with ``--assistant DRAFT``, ``assisted``
(``hf-assisted``); one worker serves all three with one copy of the weights. ``llamacpp`` --
llama-cpp-python on the GGUF as shipped (quantized kernels, so its tokens may differ from float32):
``plain`` (peer ``llamacpp``) and ``lookup`` (``llamacpp-pld``, its prompt-lookup speculative decoding,
whose tokens the bench checks against its own plain decoding's).
transformers loads the same GGUF with its own dequantizer, so it runs the same weights as hsdjax.
torch, transformers and llama-cpp-python are optional (the ``test`` / ``llamacpp`` extras).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence, TextIO

from hsdjax.errors import HsdjaxError

PEERS = {  # name -> (worker kind, decoding mode)
    "hf-ar": ("hf", "plain"),
    "hf-assisted": ("hf", "assisted"),
    "hf-pld": ("hf", "lookup"),
    "llamacpp": ("llamacpp", "plain"),
    "llamacpp-pld": ("llamacpp", "lookup"),
}
LLAMACPP_LOOKUP_TOKENS = 10  # llama.cpp's prompt lookup: tokens proposed per guess (llama-cpp-python's default)
PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt lookup: tokens proposed per guess


def peer_available(name: str) -> str | None:
    """None when the peer can run here, else why not (one line)."""
    import importlib.util

    kind = PEERS[name][0]
    needs = ("torch", "transformers") if kind == "hf" else ("llama_cpp",)
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        extra = "test" if kind == "hf" else "llamacpp"
        return f"{name} skipped: {', '.join(missing)} not installed (pip install 'hsdjax[{extra}]')"
    return None


class Worker:
    """Client of one worker process, started on ``start`` (or first use) and loading in the background;
    ``wait_ready`` blocks until it has loaded.

    One ``hf`` worker serves ``hf-ar``, ``hf-assisted`` and ``hf-pld`` with one copy of the weights."""

    def __init__(self, kind: str, model: str, eos: Sequence[int], dtype: str = "float32",
                 threads: int | None = None, assistant: str | None = None):
        self.kind, self.dtype = kind, dtype
        self.cmd = [sys.executable, "-m", "hsdjax.frontends.peers", kind, model, "--dtype", dtype,
                    "--threads", str(threads or len(os.sched_getaffinity(0))), "--eos", ",".join(map(str, eos))]
        if assistant:
            self.cmd += ["--assistant", assistant]
        self.proc: subprocess.Popen | None = None
        self.log: Any = None
        self.info: dict[str, Any] = {}

    def start(self) -> None:
        if self.proc is None:
            self.log = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                         text=True, bufsize=1)

    def _answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-20:])
            raise HsdjaxError(f"peer worker {self.kind} exited (status {rc}); its last output:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise HsdjaxError(f"peer worker {self.kind}: {answer['error']}")
        return answer

    def wait_ready(self) -> dict[str, Any]:
        self.start()
        if not self.info:
            self.info = self._answer()
        return self.info

    def generate(self, ids: list[int], max_new_tokens: int, mode: str = "plain") -> dict[str, Any]:
        self.wait_ready()
        try:
            self.proc.stdin.write(json.dumps({"ids": ids, "max_new_tokens": max_new_tokens, "mode": mode}) + "\n")
        except OSError:  # the worker died: _answer reports its status and last output
            pass
        return self._answer()

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.proc, self.info = None, {}


class Peer:
    """One named peer: a decoding mode of a worker (its own worker unless one is shared in)."""

    def __init__(self, name: str, model: str, eos: Sequence[int], dtype: str = "float32", threads: int | None = None,
                 draft: str | None = None, worker: Worker | None = None):
        kind, self.mode = PEERS[name]
        if self.mode == "assisted" and not draft:
            raise HsdjaxError(f"{name} needs a draft model of the same tokenizer")
        self.name, self.dtype = name, dtype
        self.owns_worker = worker is None
        self.worker = worker or Worker(kind, model, eos, dtype, threads, draft if self.mode == "assisted" else None)
        if self.owns_worker:  # a worker of its own starts loading at once
            self.worker.start()

    def wait_ready(self) -> dict[str, Any]:
        return self.worker.wait_ready()

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        return self.worker.generate(ids, max_new_tokens, self.mode)

    def close(self) -> None:
        if self.owns_worker:
            self.worker.close()


def start_peers(names: Sequence[str], model: str, eos: Sequence[int], dtype: str = "float32",
                threads: int | None = None, draft: str | None = None) -> tuple[dict[str, Peer], list[Worker]]:
    """The named peers over one worker per kind (so transformers' weights are loaded once)."""
    workers: dict[str, Worker] = {}
    peers = {}
    for name in names:
        kind = PEERS[name][0]
        if kind not in workers:
            wants_draft = kind == "hf" and any(PEERS[n] == ("hf", "assisted") for n in names)
            workers[kind] = Worker(kind, model, eos, dtype, threads, draft if wants_draft else None)
        peers[name] = Peer(name, model, eos, dtype, threads, draft, worker=workers[kind])
    return peers, list(workers.values())


# ------------------------------------------------------------------------------------------- worker


def _protocol_channel() -> TextIO:
    """Keep the real stdout for answers; point fd 1 and sys.stdout at stderr for everything else."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _load_hf(name: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from hsdjax.runtime import registry

    source = registry.resolve(name, check=False)
    if source.kind == "gguf":
        folder, kwargs = source.path.parent, {"gguf_file": source.path.name}
    else:
        folder, kwargs = source.path, {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
    return model.to(getattr(torch, dtype)).eval()


class _Stamps:
    """A streamer that notes when each ``put`` happens (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generator(args: argparse.Namespace, eos: list[int]):
    import torch

    torch.set_num_threads(args.threads)
    model = _load_hf(args.model, args.dtype)
    assistant = _load_hf(args.assistant, args.dtype) if args.assistant else None
    modes: dict[str, dict[str, Any]] = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}
    if assistant is not None:
        modes["assisted"] = {"assistant_model": assistant}

    def generate(ids: list[int], max_new_tokens: int, mode: str) -> dict[str, Any]:
        if mode not in modes:
            raise ValueError(f"mode {mode!r} not served by this worker (has: {', '.join(modes)})")
        extra = modes[mode]
        prompt = torch.tensor([ids])
        stamps = _Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():  # transformers refuses a streamer with assisted / lookup decoding
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos[0], use_cache=True,
                                 streamer=None if extra else stamps, **extra)
        total = time.perf_counter() - t0
        prefill = stamps.times[1] - t0 if len(stamps.times) > 1 else 0.0
        return {"tokens": out[0, len(ids):].tolist(), "prefill_s": prefill, "total_s": total}

    return generate


def llamacpp_build() -> str:
    """What the installed llama.cpp was compiled for, from its system info: the instruction sets it
    uses (``AVX2 AVX512 ...``; AMX appears only where it was built in)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    isa = [name for name, on in re.findall(r"([A-Z0-9_]+) = (\d+)", info)
           if on == "1" and name not in ("LLAMAFILE", "OPENMP", "REPACK")]
    return f"llama.cpp {llama_cpp.__version__} built for {' '.join(isa) or 'no vector extension'}"


def _llamacpp_generator(args: argparse.Namespace, eos: list[int]):
    from llama_cpp import Llama

    from hsdjax.runtime import registry

    path = str(registry.resolve(args.model, check=False).path)
    engines: dict[str, Any] = {}

    def engine(mode: str) -> Any:
        """The plain engine, or (made on first use) one with llama-cpp-python's prompt-lookup drafter,
        which needs the logits of every position; the GGUF is memory-mapped once by both."""
        if mode not in engines:
            if mode == "lookup":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                extra = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=LLAMACPP_LOOKUP_TOKENS),
                         "logits_all": True}
            else:
                extra = {}
            engines[mode] = Llama(model_path=path, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                                  verbose=False, **extra)
        return engines[mode]

    engine("plain")

    def generate(ids: list[int], max_new_tokens: int, mode: str) -> dict[str, Any]:
        if mode not in ("plain", "lookup"):
            raise ValueError(f"mode {mode!r} not served by the llama.cpp worker")
        llm = engine(mode)
        tokens: list[int] = []
        t0 = time.perf_counter()
        prefill = 0.0
        llm.reset()  # no prompt-prefix cache across requests: every engine here prefills the whole prompt
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if not tokens:
                prefill = time.perf_counter() - t0
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= max_new_tokens:
                break
        return {"tokens": tokens, "prefill_s": prefill, "total_s": time.perf_counter() - t0}

    return generate


def _torch_version() -> str:
    import torch

    return torch.__version__


def worker_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="hsdjax peer worker (JSON lines on stdin/stdout)")
    parser.add_argument("kind", choices=("hf", "llamacpp"))
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--eos", required=True, help="comma-separated stop token ids")
    parser.add_argument("--assistant", default=None, help="hf: also serve assisted generation with this draft model")
    args = parser.parse_args(argv)
    eos = [int(i) for i in args.eos.split(",")]
    channel = _protocol_channel()
    t0 = time.perf_counter()
    generate = (_hf_generator if args.kind == "hf" else _llamacpp_generator)(args, eos)
    build = llamacpp_build() if args.kind == "llamacpp" else f"torch {_torch_version()} ({args.dtype})"
    channel.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "dtype": args.dtype,
                              "build": build}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = generate(request["ids"], request["max_new_tokens"], request.get("mode", "plain"))
        except Exception as exc:  # answered, not fatal: the client raises it as one line
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    worker_main()
