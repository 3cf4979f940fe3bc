"""Load generator for any OpenAI-compatible server: N completion requests, C at a time; prints throughput
and latency percentiles.

    python -m devtools.load_test --url http://127.0.0.1:8000/v1 --model default-model \\
        --requests 200 --concurrency 200 --max-tokens 16 --prompt "Return the" --prompt "def"

Every request is ``POST {url}/completions`` (greedy unless ``--temperature``), its prompt taken in turn
from the ``--prompt`` list. A request that fails (a status other than 200, a broken connection, a
timeout) is counted and its first errors printed; the exit status is 1 when any failed. ``--json``
prints the whole report (every request's status, latency, text and token count) instead.
Needs ``httpx`` only (no torch): it runs on any machine that can reach the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

__all__ = ["LoadReport", "Outcome", "main", "percentile", "run_load"]


@dataclass
class Outcome:
    """One request: its prompt's index, HTTP status (0: no answer), seconds, and the answer's text, completion
    tokens and finish reason (or the error)."""

    prompt: int
    status: int = 0
    seconds: float = 0.0
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class LoadReport:
    """Every request's :class:`Outcome`, the wall time of the run, and the figures derived from them."""

    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def summary(self) -> dict[str, float | int]:
        """Requests sent / answered 200 / failed, requests and completion tokens per second, latency percentiles."""
        lat = sorted(o.seconds for o in self.ok)
        tokens = sum(o.completion_tokens for o in self.ok)
        wall = max(self.seconds, 1e-9)
        return {
            "requests": len(self.outcomes), "ok": len(self.ok), "failed": len(self.outcomes) - len(self.ok),
            "seconds": self.seconds, "requests_per_s": len(self.ok) / wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "latency_p50": percentile(lat, 50), "latency_p90": percentile(lat, 90),
            "latency_p99": percentile(lat, 99), "latency_max": lat[-1] if lat else math.nan,
        }


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted ``xs``, linear between the nearest ranks; NaN for none."""
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _one(client, url: str, body: dict, outcome: Outcome, gate: asyncio.Semaphore) -> None:
    async with gate:
        t = time.perf_counter()
        try:
            r = await client.post(f"{url}/completions", json=body)
            outcome.status = r.status_code
            data = r.json()
            if r.status_code == 200:
                choice = data["choices"][0]
                outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
                outcome.completion_tokens = data["usage"]["completion_tokens"]
            else:
                outcome.error = (data.get("error") or {}).get("message") or r.text
        except Exception as e:  # noqa: BLE001 - a failed request is a result of the load test, not its end
            outcome.error = f"{type(e).__name__}: {e}"
        outcome.seconds = time.perf_counter() - t


async def _run(url: str, model: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int,
               temperature: float, timeout: float) -> LoadReport:
    import httpx

    url = url.rstrip("/")
    gate = asyncio.Semaphore(concurrency)
    report = LoadReport(outcomes=[Outcome(prompt=i % len(prompts)) for i in range(requests)])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*[
            _one(client, url, {"model": model, "prompt": prompts[o.prompt], "max_tokens": max_tokens,
                               "temperature": temperature}, o, gate)
            for o in report.outcomes
        ])
        report.seconds = time.perf_counter() - start
    return report


def run_load(url: str, model: str, prompts: list[str], *, requests: int = 200, concurrency: int = 200,
             max_tokens: int = 16, temperature: float = 0.0, timeout: float = 600.0) -> LoadReport:
    """Send ``requests`` completions to ``url`` (``.../v1``), ``concurrency`` in flight at once.

    Args:
        url: the API's base URL, ending in ``/v1``.
        model: the served model's name.
        prompts: taken in turn, request ``i`` gets ``prompts[i % len(prompts)]``.
        requests / concurrency / max_tokens / temperature: the load and each request's options.
        timeout: seconds one request may take.
    Returns:
        A :class:`LoadReport` (the outcomes in request order).
    """
    if not prompts or requests < 1 or concurrency < 1:
        raise SystemExit("pass at least one --prompt, --requests >= 1 and --concurrency >= 1")
    return asyncio.run(_run(url, model, prompts, requests, concurrency, max_tokens, temperature, timeout))


def main(argv: list[str] | None = None) -> int:
    """The command line; 1 when a request failed."""
    p = argparse.ArgumentParser(prog="python -m devtools.load_test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API's base URL (default: %(default)s)")
    p.add_argument("--model", required=True, help="the served model's name (GET /v1/models lists it)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several, used in turn)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=200, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = p.parse_args(argv)
    report = run_load(args.url, args.model, args.prompt or ["Hello"], requests=args.requests,
                      concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature,
                      timeout=args.timeout)
    s = report.summary()
    if args.json:
        print(json.dumps({"summary": s, "outcomes": [asdict(o) for o in report.outcomes]}))
    else:
        print(f"{s['ok']} of {s['requests']} requests answered 200 in {s['seconds']:.2f} s: "
              f"{s['requests_per_s']:.2f} requests/s, {s['tokens_per_s']:.1f} completion tokens/s")
        print(f"latency p50 {s['latency_p50']:.3f} s, p90 {s['latency_p90']:.3f} s, p99 {s['latency_p99']:.3f} s, "
              f"max {s['latency_max']:.3f} s")
        for o in [o for o in report.outcomes if o.status != 200][:5]:
            print(f"failed (status {o.status}): {o.error}", file=sys.stderr)
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
