"""Server metrics in the Prometheus text format (no client library needed for a handful of series)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# What the scheduler's live gauges (`Metrics.gauges`, set by serving/engine.py) measure, for their HELP lines.
GAUGE_HELP = {
    "rdepth_lora_adapters": "LoRA adapters served (--lora-modules and runtime loads).",
    "rdepth_queue_depth": "Requests waiting to start.",
    "rdepth_running_sequences": "Sequences generating now.",
    "rdepth_max_batch": "Sequences the continuous batch holds at most (--max-batch).",
    "rdepth_kv_pool_bytes": "Bytes the batch's KV slot pool holds.",
}

class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: le buckets, sum and count)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Counters and histograms updated by the HTTP layer and the engine thread (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.core_steps = 0
        self.decode_steps = 0  # batched core-step iterations
        self.batch_rows = 0  # rows summed over those iterations
        self.adapter_switches = 0  # LoRA adapter changes between requests (--lora-modules)
        self.latency = Histogram()
        self.ttft = Histogram()
        # Live values read at scrape time (the engine provides them).
        self.gauges: dict[str, Callable[[], float]] = {}

    def request_done(self, endpoint: str, status: int, seconds: float | None) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1
            if seconds is not None and status < 400:
                self.latency.observe(seconds)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] += 1

    def prompt(self, tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += tokens

    def token(self, steps: int) -> None:
        with self.lock:
            self.generation_tokens += 1
            self.core_steps += steps

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def decode_step(self, rows: int) -> None:
        with self.lock:
            self.decode_steps += 1
            self.batch_rows += rows

    def adapter_switch(self) -> None:
        with self.lock:
            self.adapter_switches += 1

    def render(self) -> str:
        """The Prometheus exposition text."""
        with self.lock:
            lines = [
                "# HELP rdepth_requests_total HTTP requests answered, by endpoint and status code.",
                "# TYPE rdepth_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'rdepth_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            lines += ["# HELP rdepth_rejected_total Requests refused before generation (overload).",
                      "# TYPE rdepth_rejected_total counter"]
            for reason, n in sorted(self.rejected.items()):
                lines.append(f'rdepth_rejected_total{{reason="{reason}"}} {n}')
            mean_steps = self.core_steps / self.generation_tokens if self.generation_tokens else 0.0
            mean_batch = self.batch_rows / self.decode_steps if self.decode_steps else 0.0
            scalars = [
                ("rdepth_prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
                ("rdepth_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
                ("rdepth_core_steps_total", "counter", "Recurrence steps run for generated tokens.", self.core_steps),
                ("rdepth_mean_steps_per_token", "gauge", "Mean recurrence steps per generated token.", mean_steps),
                ("rdepth_decode_steps_total", "counter", "Batched recurrence-step iterations run.",
                 self.decode_steps),
                ("rdepth_batch_rows_total", "counter", "Sequences summed over batched recurrence steps.",
                 self.batch_rows),
                ("rdepth_mean_batch_rows", "gauge", "Mean sequences per batched recurrence step.", mean_batch),
                ("rdepth_adapter_switches_total", "counter", "Changes of the LoRA adapter turned on (--lora-modules): "
                 "for solo requests of another adapter, or, where adapters cannot share a batch, the batch drained "
                 "for requests of another.", self.adapter_switches),
            ]
            for name, kind, text, value in scalars:
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {_fmt(value)}"]
            for name, fn in sorted(self.gauges.items()):
                help_line = [f"# HELP {name} {GAUGE_HELP[name]}"] if name in GAUGE_HELP else []
                lines += [*help_line, f"# TYPE {name} gauge", f"{name} {_fmt(fn())}"]
            lines += ["# HELP rdepth_request_latency_seconds End-to-end latency of successful requests.",
                      "# TYPE rdepth_request_latency_seconds histogram", *self.latency.lines(
                          "rdepth_request_latency_seconds")]
            lines += ["# HELP rdepth_time_to_first_token_seconds From arrival to the first generated token.",
                      "# TYPE rdepth_time_to_first_token_seconds histogram", *self.ttft.lines(
                          "rdepth_time_to_first_token_seconds")]
        return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"
