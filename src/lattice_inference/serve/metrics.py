"""Prometheus metrics of the server, in a registry of its own (so several servers can share a process)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lattice_inference.metrics import GenerationMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Requests by endpoint and status, tokens, time to first token, latency, queue depth, and acceptance."""

    def __init__(self, info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.info = dict(info or {})
        """What the server runs on: model, device, dtype (the ``lattice_model_info`` gauge's labels)."""
        if self.info:
            info_gauge = Gauge(
                "lattice_model_info", "The served model, its device and dtype (always 1)", list(self.info), registry=r
            )
            info_gauge.labels(**self.info).set(1)
        self.requests = Counter(
            "lattice_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("lattice_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter(
            "lattice_cached_prompt_tokens",
            "Prompt tokens whose cache rows a prefill kept from the tenant's earlier requests (the prefix cache)",
            registry=r,
        )
        self.generated_tokens = Counter(
            "lattice_generated_tokens", "Tokens generated (cancelled generations included)", ["method"], registry=r
        )
        self.generations = Counter(
            "lattice_generations",
            "Generations run, by method and finish reason",
            ["method", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "lattice_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "lattice_request_latency_seconds",
            "From request arrival to the last byte of a generation's response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("lattice_queue_depth", "Generation requests waiting to start", registry=r)
        self.running = Gauge("lattice_generations_running", "Generations running now", registry=r)
        self.taking_in = Gauge(
            "lattice_prompts_taking_in", "Requests whose prompts are being taken in by chunks", registry=r
        )
        self.prompt_rows_left = Gauge(
            "lattice_prompt_rows_left", "Prompt rows those requests have left to take in", registry=r
        )
        self.drafts = Counter("lattice_drafts", "Verification rounds with a draft", ["method"], registry=r)
        self.drafted = Counter("lattice_draft_tokens", "Drafted tokens", ["method"], registry=r)
        self.accepted = Counter("lattice_accepted_draft_tokens", "Drafted tokens accepted", ["method"], registry=r)
        self.acceptance_rate = Gauge(
            "lattice_draft_acceptance_rate", "Accepted / drafted tokens since start", ["method"], registry=r
        )
        self.acceptance_length = Gauge(
            "lattice_mean_acceptance_length",
            "1 + accepted / drafts since start (vLLM's definition)",
            ["method"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._totals: dict[str, GenerationMetrics] = {}

    def watch_intake(self, taking_in: Callable[[], tuple[int, int]]) -> None:
        """Report the prompts being taken in by chunks (``taking_in()``: requests and their prompt rows left) at
        each scrape."""
        self.taking_in.set_function(lambda: taking_in()[0])
        self.prompt_rows_left.set_function(lambda: taking_in()[1])

    def set_depth(self, waiting: int, running: int) -> None:
        """Record the queue's state (called by the worker and on submit)."""
        self.queue_depth.set(waiting)
        self.running.set(running)

    def observe_generation(self, method: str, m: GenerationMetrics, finish_reason: str) -> None:
        """Add one finished (or cancelled) generation's tokens and acceptance counts."""
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_prompt_tokens.inc(m.cached_prompt_tokens)
        self.generated_tokens.labels(method).inc(m.new_tokens)
        self.generations.labels(method, finish_reason).inc()
        self.drafts.labels(method).inc(m.drafts)
        self.drafted.labels(method).inc(m.drafted_tokens)
        self.accepted.labels(method).inc(m.accepted_tokens)
        with self._lock:
            total = self._totals.setdefault(method, GenerationMetrics())
            total.drafts += m.drafts
            total.drafted_tokens += m.drafted_tokens
            total.accepted_tokens += m.accepted_tokens
            self.acceptance_rate.labels(method).set(total.acceptance_rate)
            self.acceptance_length.labels(method).set(total.mean_acceptance_length)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
