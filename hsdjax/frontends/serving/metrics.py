"""Server metrics, rendered in the Prometheus text exposition format (``GET /metrics``).

Counters are updated from the event loop (HTTP side) and the scheduler thread, under one lock.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

KNOWN_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
RATE_WINDOW_S = 10.0


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished = collections.Counter()  # by finish reason (stop, length, cancelled, error)
        self.decoded_tokens = 0  # tokens from verification passes (the prefill's first token excluded)
        self.target_passes = 0
        self.decode_calls: collections.Counter[str] = collections.Counter()  # by drafter used
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.gauges: Callable[[], dict[str, Any]] = lambda: {}

    # ------------------------------------------------------------------ updates
    def request(self, endpoint: str, status: int) -> None:
        endpoint = endpoint if endpoint in KNOWN_ENDPOINTS else "other"
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def request_done(self, reason: str, prompt_tokens: int, decoded: int, passes: int) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.prompt_tokens += prompt_tokens
            self.decoded_tokens += max(decoded, 0)
            self.target_passes += passes

    def decode_call(self, drafter: str) -> None:
        with self._lock:
            self.decode_calls[drafter] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    # ------------------------------------------------------------------ views
    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def mean_accepted_length(self) -> float:
        with self._lock:
            return self.decoded_tokens / self.target_passes if self.target_passes else 0.0

    def render(self) -> str:
        gauges = self.gauges()
        tps = self.tokens_per_s()
        mal = self.mean_accepted_length()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

        with self._lock:
            metric("hsdjax_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("hsdjax_errors_total", "counter", "Error responses and failed generations by type.",
                   [({"type": k}, n) for k, n in sorted(self.errors.items())])
            metric("hsdjax_requests_finished_total", "counter", "Generations finished, by finish reason.",
                   [({"reason": k}, n) for k, n in sorted(self.finished.items())])
            metric("hsdjax_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [({}, self.prompt_tokens)])
            metric("hsdjax_generation_tokens_total", "counter", "Completion tokens generated.",
                   [({}, self.generated_tokens)])
            metric("hsdjax_target_passes_total", "counter", "Target verification passes (per row).",
                   [({}, self.target_passes)])
            metric("hsdjax_decode_calls_total", "counter", "Batched decode calls by the drafter used.",
                   [({"drafter": k}, n) for k, n in sorted(self.decode_calls.items())])
            lines.append("# HELP hsdjax_time_to_first_token_seconds Arrival to first generated token.")
            lines.append("# TYPE hsdjax_time_to_first_token_seconds summary")
            lines.append(f"hsdjax_time_to_first_token_seconds_sum {round(self.ttft_sum, 6)}")
            lines.append(f"hsdjax_time_to_first_token_seconds_count {self.ttft_count}")
        metric("hsdjax_generation_tokens_per_second", "gauge",
               f"Completion tokens per second over the last {RATE_WINDOW_S:.0f} s.", [({}, round(tps, 3))])
        metric("hsdjax_mean_accepted_length", "gauge",
               "Tokens per target verification pass over finished generations (bonus token included).",
               [({}, round(mal, 4))])
        for name, (value, help) in gauges.items():
            metric(f"hsdjax_{name}", "gauge", help, [({}, value)])
        return "\n".join(lines) + "\n"
