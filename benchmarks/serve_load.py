"""Loopback load on `hsdjax serve`: throughput and latency with 1, 4, 16 concurrent clients.

    python benchmarks/serve_load.py                                  # starts a server per variant
    python benchmarks/serve_load.py --variants ar,pld,pld@1 --clients 1,4,16 --requests 2 --max-tokens 64
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --variants pld   # an already running server
    python benchmarks/serve_load.py --questions ../shared/data/eval/mt_bench.jsonl --limit 16
    python benchmarks/serve_load.py --scenario multiturn --variants ar --max-context 2048   # prefix reuse
    python benchmarks/serve_load.py --scenario arrival --variants ar --max-context 2048     # chunked prefill
    python benchmarks/serve_load.py --scenario coldstart --variants pld --max-context 2048  # first requests
    python benchmarks/serve_load.py --scenario abuse --variants pld --max-context 2048  # RSS over repeats

A variant is a method (``ar``, ``pld``, ``sps``), optionally ``@N`` for ``--spec-max-active N``
(speculate only while at most N rows are busy; ``@none``: always speculate; no suffix: the server's
default, ``auto``). Each client streams greedy chat completions
(``stream_options.include_usage``), one after another, ``--requests`` each; prompts are spread over
the clients. Before each level, the same clients run one short untimed round (so the shapes that level
needs, such as prompt buckets and batch sizes, are compiled). Printed per (variant, clients): completion tokens/s over
the wall time of the level, p50/p90/p99 time to first content token and total request time, and the
mean accepted length reported by the server.

Measured on 2 CPU cores (SmolLM2-135M, float32, --max-batch 8, --max-context 1024, --requests 3,
--max-tokens 64; completion tokens/s, then p50 time to first token / p50 total):

    variant    1 client           4 clients          16 clients
    ar         29.9  0.20/2.06 s  49.1  0.59/4.49 s  63.6  6.93/12.80 s   (16 vs 1: 2.13x)
    pld        21.9  0.22/2.97 s  47.2  0.66/4.58 s  59.2  7.51/14.19 s   (auto: ar when > 1 row busy; 2.71x)
    pld@none   15.4  0.26/4.16 s  19.9  0.83/11.2 s  22.0  19.4/33.9 s    (always speculate, --requests 2)

With 16 clients and 8 rows, half the requests wait for a row: that is the time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Here is a Python function:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\nRewrite it with type hints and a docstring.",
    "Explain what a hash map is and give a short Python example.",
    "Summarize this paragraph in two sentences: The mitochondria is the powerhouse of the cell. It produces "
    "energy in the form of ATP through cellular respiration, and it has its own DNA, which suggests it was "
    "once an independent organism that entered a symbiotic relationship with early eukaryotic cells.",
    "Write a short story about a robot who learns to paint.",
    "What are three tips for writing clean code?",
    "Convert this list to a JSON object with keys name and age: Alice 31, Bob 27, Carol 45.",
    "Describe the water cycle for a ten-year-old.",
    "Write a SQL query that returns the ten most recent orders from a table orders(id, created_at, total).",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, method: str, spec_max_active: str | None, *extra: str
                 ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hsdjax.frontends.cli", "serve", "--port", str(port), "--method", method,
           "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
           "--max-context", str(args.max_context), "--rounds", str(args.rounds), "--log-level", "warning", *extra]
    if args.model:
        cmd += ["--model", args.model]
    if spec_max_active is not None:
        cmd += ["--spec-max-active", spec_max_active]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {method} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server for {method} not ready")


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str | list[dict[str, str]],
                      max_tokens: int, started: asyncio.Event | None = None) -> dict[str, Any]:
    """One streamed greedy chat completion: status, time to first content, total time, the arrival
    times of its content chunks, its text and usage (``started`` is set at its first content)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage, extra = None, None
    chunks, text = [], []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"status": resp.status_code}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            content = event["choices"][0].get("delta", {}).get("content") if event.get("choices") else None
            if content:
                chunks.append(time.perf_counter())
                text.append(content)
                if ttft is None:
                    ttft = chunks[-1] - t0
                    if started is not None:
                        started.set()
            if event.get("usage"):
                usage, extra = event["usage"], event.get("hsdjax")
    total = time.perf_counter() - t0
    return {"status": 200, "ttft": ttft if ttft is not None else total, "total": total,
            "tokens": usage["completion_tokens"] if usage else 0, "chunks": chunks, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "cached": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "accepted": (extra or {}).get("mean_accepted_length"), "passes": (extra or {}).get("target_passes")}


async def level(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int
                ) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        async def client(c: int) -> list[dict[str, Any]]:
            out = []
            for r in range(requests):
                out.append(await one_request(http, url, model, prompts[(c * requests + r) % len(prompts)], max_tokens))
            return out

        t0 = time.perf_counter()
        results = [x for xs in await asyncio.gather(*(client(c) for c in range(clients))) for x in xs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    tokens = sum(r["tokens"] for r in ok)
    passes = sum(r["passes"] or 0 for r in ok)
    return {
        "clients": clients, "requests": len(results), "errors": len(results) - len(ok), "tokens": tokens,
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50": percentile([r["ttft"] for r in ok], 0.5), "ttft_p90": percentile([r["ttft"] for r in ok], 0.9),
        "ttft_p99": percentile([r["ttft"] for r in ok], 0.99),
        "total_p50": percentile([r["total"] for r in ok], 0.5), "total_p90": percentile([r["total"] for r in ok], 0.9),
        "total_p99": percentile([r["total"] for r in ok], 0.99),
        # tokens per target pass over the level (the first token of each request comes from the prefill)
        "accepted": round((tokens - len(ok)) / passes, 3) if passes else None,
    }


def long_documents(path: Path, lo_chars: int, hi_chars: int, count: int) -> list[str]:
    """Meeting-transcript prompts (QMSum, in the shared training prompts) of lo..hi characters, in file
    order: long first turns (about 4 characters a token)."""
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if q.get("source") == "qmsum" and lo_chars <= len(q["prompt"]) <= hi_chars:
            out.append(q["prompt"])
            if len(out) == count:
                break
    if len(out) < count:
        raise SystemExit(f"{path}: only {len(out)} QMSum prompts of {lo_chars}-{hi_chars} characters")
    return out


async def conversation(http: httpx.AsyncClient, url: str, model: str, document: str, max_tokens: int
                       ) -> dict[str, Any]:
    """A two-turn chat: the document and its question, then a follow-up on the answer."""
    turn1 = [{"role": "user", "content": document}]
    first = await one_request(http, url, model, turn1, max_tokens)
    turn2 = turn1 + [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "Now give that answer a title of at most eight words."}]
    second = await one_request(http, url, model, turn2, max_tokens)
    return {"turn1_tokens": first["prompt_tokens"], "turn2_tokens": second["prompt_tokens"], "ttft1": first["ttft"],
            "ttft2": second["ttft"], "cached": second["cached"], "texts": (first["text"], second["text"])}


def run_multiturn(args: argparse.Namespace) -> int:
    """Turn-2 time to first token with prefix reuse and without (``--prefix-cache-mb 0``): both servers
    run side by side and each conversation goes to one, then the other (interleaved pairs)."""
    docs = long_documents(Path(args.documents), 3600, 4600, args.conversations + 1)
    print(f"{'variant':<8} {'turn-1 tokens':>13} {'turn-2 tokens':>13} {'cached':>7} {'ttft2 reuse s':>13} "
          f"{'ttft2 none s':>12} {'ratio':>6} {'same text':>9}", flush=True)
    for method in args.variants.split(","):
        servers = [start_server(args, method, None), start_server(args, method, None, "--prefix-cache-mb", "0")]
        try:
            model = httpx.get(f"{servers[0][1]}/v1/models", timeout=10).json()["data"][0]["id"]

            async def pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
                async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as http:
                    for _, url in servers:  # untimed: compiles the shapes of these prompt lengths
                        await conversation(http, url, model, docs[-1], args.max_tokens)
                    return [(await conversation(http, servers[0][1], model, d, args.max_tokens),
                             await conversation(http, servers[1][1], model, d, args.max_tokens)) for d in docs[:-1]]

            results = asyncio.run(pairs())
        finally:
            for proc, _ in servers:
                stop(proc)
        for reuse, none in results:
            print(f"{method:<8} {reuse['turn1_tokens']:>13} {reuse['turn2_tokens']:>13} {reuse['cached']:>7} "
                  f"{reuse['ttft2']:>13.3f} {none['ttft2']:>12.3f} {none['ttft2'] / reuse['ttft2']:>5.1f}x "
                  f"{str(reuse['texts'] == none['texts']):>9}", flush=True)
        med = lambda key, i: percentile([pair[i][key] for pair in results], 0.5)  # noqa: E731
        print(f"{method}: median turn-2 time to first token {med('ttft2', 0):.3f} s with reuse, {med('ttft2', 1):.3f} s "
              f"without ({med('ttft2', 1) / med('ttft2', 0):.1f}x); identical answers: "
              f"{sum(r['texts'] == n['texts'] for r, n in results)}/{len(results)}", flush=True)
    return 0


async def arrival(url: str, model: str, prompts: list[str], long_prompt: str, streams: int, max_tokens: int,
                  delay: float) -> dict[str, Any]:
    """``streams`` streaming requests run; after ``delay`` s a long prompt arrives. Gaps between the
    streams' content chunks: in the 3 s before it arrived (all streams admitted and decoding), while it
    was prefilled (from its arrival to its first token; without chunking there is none: one gap spans
    the whole prefill), and the longest gap spanning its arrival or its admission (which includes its
    first token and the batch's first decode call with its long row)."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        tasks = [asyncio.create_task(one_request(http, url, model, prompts[i % len(prompts)], max_tokens))
                 for i in range(streams)]
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        long = await one_request(http, url, model, long_prompt, 8)
        first = sent + long["ttft"]
        results = await asyncio.gather(*tasks)
    gaps = [(a, b) for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    before = [b - a for a, b in gaps if sent - 3.0 <= a and b <= sent]  # steady decoding, all admitted
    during = [b - a for a, b in gaps if a >= sent and b <= first]  # while it was prefilled
    stalled = [b - a for a, b in gaps if a < sent < b or a < first < b]  # spanning its arrival or admission
    return {"long_tokens": long["prompt_tokens"], "long_ttft": long["ttft"], "before_p50": percentile(before, 0.5),
            "during_p50": percentile(during, 0.5), "during_p99": percentile(during, 0.99), "during_n": len(during),
            "edge_max": max(stalled, default=float("nan"))}


def run_arrival(args: argparse.Namespace) -> int:
    """Inter-chunk latency of running streams while a long prompt arrives, per ``--prefill-chunks``
    value (one server each; 2048 prefills a 2,000-token prompt in one piece, as without chunking).
    The batch has a row free for the long prompt (``--max-batch`` at least streams + 1), so the window
    from its arrival to its first token is its prefill."""
    long_prompt = "\n\n".join(long_documents(Path(args.documents), 4300, 4400, 2))  # about 2,000 tokens
    args.max_batch = max(args.max_batch, args.streams + 1)  # a row for it at once: no wait in the queue
    print(f"{'variant':<8} {'chunk':>5} {'long prompt':>11} {'its ttft s':>10} {'gap p50 before':>14} "
          f"{'gap p50 during':>14} {'gap p99 during':>14} {'p99/p50':>7} {'edge gap max':>12}", flush=True)
    for method in args.variants.split(","):
        for chunk in args.prefill_chunks.split(","):
            # no prefix reuse: the timed run would find the untimed run's prompt
            proc, url = start_server(args, method, None, "--prefill-chunk", chunk, "--prefix-cache-mb", "0")
            try:
                model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                run = lambda: asyncio.run(arrival(url, model, PROMPTS, long_prompt, args.streams,  # noqa: E731
                                                  args.stream_tokens, args.delay))
                run()  # untimed: compiles the pieces and the long prompt's buckets
                r = run()
            finally:
                stop(proc)
            print(f"{method:<8} {chunk:>5} {r['long_tokens']:>11} {r['long_ttft']:>10.2f} {r['before_p50']:>14.3f} "
                  f"{r['during_p50']:>14.3f} {r['during_p99']:>14.3f} {r['during_p99'] / r['before_p50']:>6.1f}x "
                  f"{r['edge_max']:>12.3f}", flush=True)
    return 0


async def cold_and_warm(url: str, model: str, documents: list[str], chars: int, streams: int,
                        max_tokens: int) -> dict[str, Any]:
    """The first request of about ``chars`` characters (its prompt bucket never seen), then another of
    the same length (warm), each while ``streams`` streams decode: both times to first token and the
    streams' largest gap against their median gap."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        out: dict[str, Any] = {}
        for name, doc in (("cold", documents[0]), ("warm", documents[1])):
            started = [asyncio.Event() for _ in range(streams)]
            tasks = [asyncio.create_task(one_request(http, url, model, PROMPTS[i % len(PROMPTS)], max_tokens,
                                                     started[i])) for i in range(streams)]
            # the streams are decoding (all admitted: the first burst after a start admits them one per
            # decode call and took ~4 s, so a fixed 2 s wait timed the admissions, not the new prompt)
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
            await asyncio.sleep(1.0)
            r = await one_request(http, url, model, doc[:chars], 4)
            runs = await asyncio.gather(*tasks)
            gaps = [b - a for x in runs for a, b in zip(x["chunks"], x["chunks"][1:])]
            out[name] = {"tokens": r["prompt_tokens"], "ttft": r["ttft"], "gap_p50": percentile(gaps, 0.5),
                         "gap_max": max(gaps, default=float("nan")), "gap_p99": percentile(gaps, 0.99)}
        return out


def rss_mb(proc: subprocess.Popen) -> float:
    """The server process's resident memory (Linux), MB."""
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_coldstart(args: argparse.Namespace) -> int:
    """Start-up (load and warm-up until /health is ready), then for each prompt length the first
    request of that length against a second one (a different document, so no prefix is reused), each
    arriving while ``--streams`` streams decode: its time to first token and the streams' gaps."""
    docs = long_documents(Path(args.documents), max(int(c) for c in args.lengths.split(",")), 10**6,
                          2 * len(args.lengths.split(",")))
    args.max_batch = max(args.max_batch, args.streams + 1)  # a row for it at once: no wait in the queue
    print(f"{'variant':<8} {'start s':>7} {'prompt':>6} {'cold ttft':>9} {'warm ttft':>9} {'cold/warm':>9} "
          f"{'streams gap p50':>15} {'gap p99 cold':>12} {'gap max cold':>12}", flush=True)
    for method in args.variants.split(","):
        t0 = time.perf_counter()
        proc, url = start_server(args, method, None, "--prefix-cache-mb", "0")
        start_s = time.perf_counter() - t0
        try:
            print(f"{method}: ready after {start_s:.1f} s, RSS {rss_mb(proc):.0f} MB", flush=True)
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            for i, chars in enumerate(int(c) for c in args.lengths.split(",")):
                r = asyncio.run(cold_and_warm(url, model, docs[2 * i: 2 * i + 2], chars, args.streams,
                                              args.stream_tokens))
                c, w = r["cold"], r["warm"]
                print(f"{method:<8} {start_s:>7.1f} {c['tokens']:>6} {c['ttft']:>9.2f} {w['ttft']:>9.2f} "
                      f"{c['ttft'] / w['ttft']:>8.2f}x {c['gap_p50']:>15.3f} {c['gap_p99']:>12.3f} "
                      f"{c['gap_max']:>12.3f}", flush=True)
            print(f"{method}: RSS after the requests {rss_mb(proc):.0f} MB", flush=True)
            time.sleep(5.0)  # idle: the running state dropped, the heap trimmed
            print(f"{method}: RSS idle after the requests {rss_mb(proc):.0f} MB", flush=True)
        finally:
            stop(proc)
    return 0


async def abuse_round(url: str, model: str, docs: list[str], seed: int) -> collections.Counter:
    """One round of what a hostile or careless crowd sends (issue #51's sweep, condensed): 24 streams of
    which half disconnect mid-answer, long prompts, n = 3 choices with logprobs, random Unicode and
    extreme numbers in every field, a burst of 80 requests (some get 429), a 10 MB body (413). Returns
    the count of each status; a 5xx is a failure of the server."""
    rng = random.Random(seed)
    status: collections.Counter = collections.Counter()
    chat = f"{url}/v1/chat/completions"
    junk = ["\ud800", "\U0010ffff", "\x00", "\u202e", "é" * 500, "", " ", "\n" * 50, "🙂" * 100]
    numbers = [-1e308, 1e308, 2**63, -(2**63), 1e-45, float("nan"), float("inf"), 0, -1, 3.5]
    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "logprobs",
              "top_logprobs", "presence_penalty", "logit_bias", "user", "stream"]

    def body(**kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": 16,
                "temperature": 0, **kw}

    async def post(http: httpx.AsyncClient, payload: Any, raw: bytes | None = None) -> None:
        try:
            if raw is not None:
                r = await http.post(chat, content=raw, headers={"content-type": "application/json"})
            else:
                r = await http.post(chat, content=json.dumps(payload, allow_nan=True).encode("utf-8", "surrogatepass"),
                                    headers={"content-type": "application/json"})
            status[r.status_code] += 1
        except httpx.HTTPError as exc:
            status[type(exc).__name__] += 1

    async def stream(http: httpx.AsyncClient, payload: dict[str, Any], cut_after: int | None) -> None:
        try:
            async with http.stream("POST", chat, json=payload) as resp:
                status[resp.status_code] += 1
                n = 0
                async for _ in resp.aiter_lines():
                    n += 1
                    if cut_after is not None and n >= cut_after:
                        break  # the client goes away mid-answer
        except httpx.HTTPError as exc:
            status[type(exc).__name__] += 1

    limits = httpx.Limits(max_connections=128, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        streams = [stream(http, body(max_tokens=64, stream=True), rng.randint(2, 12) if i % 2 else None)
                   for i in range(24)]
        longs = [post(http, body(messages=[{"role": "user", "content": d}], max_tokens=8)) for d in docs]
        choices = [post(http, body(n=3, temperature=0.8, logprobs=True, top_logprobs=5, seed=i)) for i in range(4)]
        hostile = []
        for _ in range(40):
            field = rng.choice(fields)
            value = rng.choice(junk) if rng.random() < 0.5 else rng.choice(numbers)
            hostile.append(post(http, body(**{field: value})))
        await asyncio.gather(*streams, *longs, *choices, *hostile)
        await asyncio.gather(*(post(http, body(max_tokens=1)) for _ in range(80)))  # a burst
        await post(http, None, raw=b'{"messages": "' + b"x" * (10 * 2**20) + b'"}')
    return status


def run_abuse(args: argparse.Namespace) -> int:
    """RSS at ready, then after each of ``--rounds-abuse`` identical abuse rounds (idle for a few seconds
    first, as a server between bursts): the growth of a repeat says whether anything accumulates."""
    docs = long_documents(Path(args.documents), 3000, 8000, 4)
    for method in args.variants.split(","):
        proc, url = start_server(args, method, None)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            rss = [rss_mb(proc)]
            print(f"{method}: RSS at ready {rss[0]:.0f} MB", flush=True)
            for i in range(args.rounds_abuse):
                t0 = time.perf_counter()
                status = asyncio.run(abuse_round(url, model, docs, seed=i % 2))
                time.sleep(5.0)  # idle: the scheduler drops the running state and trims the heap
                rss.append(rss_mb(proc))
                bad = sum(v for k, v in status.items() if isinstance(k, int) and k >= 500)
                print(f"{method}: round {i + 1} ({time.perf_counter() - t0:.0f} s): RSS idle {rss[-1]:.0f} MB "
                      f"({rss[-1] - rss[-2]:+.0f} MB); statuses {dict(sorted(status.items(), key=str))}; "
                      f"5xx {bad}", flush=True)
            if len(rss) >= 3:
                print(f"{method}: last repeat grew RSS by {100 * (rss[-1] / rss[-2] - 1):+.1f}%", flush=True)
        finally:
            stop(proc)
    return 0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def read_prompts(args: argparse.Namespace) -> list[str]:
    if not args.questions:
        return PROMPTS
    out = []
    for path in args.questions:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                out.append(q["turns"][0] if "turns" in q else q.get("prompt") or q["question"])
    return out[: args.limit] if args.limit else out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="use a running server (then --variants names its method)")
    p.add_argument("--model", default=None)
    p.add_argument("--variants", default="ar,pld", help="methods, METHOD@N for --spec-max-active N (default ar,pld)")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=2, help="requests per client per level (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--questions", action="append", default=None, help="JSONL question files (turns[0] is used)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per level")
    p.add_argument("--scenario", choices=("load", "multiturn", "arrival", "coldstart", "abuse"), default="load",
                   help="load: clients levels (default); multiturn: turn-2 time to first token with and without "
                        "prefix reuse; arrival: running streams' latency while a long prompt arrives; "
                        "coldstart: start-up time and the first request of each length against a warm one; "
                        "abuse: RSS after repeated rounds of hostile and careless requests")
    p.add_argument("--rounds-abuse", type=int, default=3, help="abuse: rounds (default 3)")
    p.add_argument("--lengths", default="400,800,1600,3200,6000",
                   help="coldstart: prompt lengths in characters (default 400,800,1600,3200,6000: ~100-1,500 tokens)")
    p.add_argument("--documents", default=str(ROOT.parent / "shared/data/train/prompts_more.jsonl"),
                   help="where the long prompts come from (QMSum transcripts)")
    p.add_argument("--conversations", type=int, default=4, help="multiturn: conversations per server (default 4)")
    p.add_argument("--prefill-chunks", default="auto,64,2048",
                   help="arrival: --prefill-chunk values (default auto,64,2048; 2048: one piece, as without chunking)")
    p.add_argument("--streams", type=int, default=8, help="arrival: running streams (default 8)")
    p.add_argument("--stream-tokens", type=int, default=256, help="arrival: max_tokens of the streams (default 256)")
    p.add_argument("--delay", type=float, default=8.0, help="arrival: seconds before the long prompt (default 8)")
    args = p.parse_args()
    if args.scenario == "multiturn":
        return run_multiturn(args)
    if args.scenario == "arrival":
        return run_arrival(args)
    if args.scenario == "coldstart":
        return run_coldstart(args)
    if args.scenario == "abuse":
        return run_abuse(args)
    prompts = read_prompts(args)
    clients = [int(c) for c in args.clients.split(",")]
    rows = []
    print(f"{'variant':<8} {'clients':>7} {'reqs':>5} {'err':>4} {'tokens':>6} {'wall s':>7} {'tok/s':>7} "
          f"{'ttft p50/p90/p99 s':>20} {'total p50/p90/p99 s':>21} {'tok/pass':>8}", flush=True)
    for variant in args.variants.split(","):
        method, _, n = variant.partition("@")
        proc = None
        if args.url:
            url = args.url
        else:
            proc, url = start_server(args, method, n or None)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            for c in clients:
                asyncio.run(level(url, model, prompts, c, 1, 4))  # untimed: compiles this level's shapes
                r = dict(asyncio.run(level(url, model, prompts, c, args.requests, args.max_tokens)), variant=variant)
                rows.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
                else:
                    print(f"{variant:<8} {c:>7} {r['requests']:>5} {r['errors']:>4} {r['tokens']:>6} "
                          f"{r['wall_s']:>7.1f} {r['tokens_per_s']:>7.1f} "
                          f"{r['ttft_p50']:>6.2f}/{r['ttft_p90']:>5.2f}/{r['ttft_p99']:>5.2f}"
                          f"     {r['total_p50']:>6.2f}/{r['total_p90']:>5.2f}/{r['total_p99']:>5.2f}"
                          f"  {r['accepted'] if r['accepted'] is not None else '-':>8}", flush=True)
        finally:
            if proc is not None:
                stop(proc)
    by = {(r["variant"], r["clients"]): r["tokens_per_s"] for r in rows}
    for variant in args.variants.split(","):
        lo, hi = by.get((variant, min(clients))), by.get((variant, max(clients)))
        if lo and hi:
            print(f"{variant}: {max(clients)} clients vs {min(clients)}: {hi / lo:.2f}x tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
