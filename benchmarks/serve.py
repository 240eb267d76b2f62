"""Load benchmark of `hexq serve`: concurrent clients on mixed-domain traffic, per precision policy.

    python benchmarks/serve.py                                  # both reference models, static and online
    python benchmarks/serve.py --models mixtral --clients 8 --requests 4 --max-tokens 16

Artifacts: each reference model calibrated with experts-mixed on 32 windows and packed at 3.0 bits on average with
the online policy's widths banked (made in --work if missing). For every (model, policy) a fresh `hexq serve`
process runs on a loopback port with the expert cache at --budget-share of the experts' bytes (so the cache has to
choose, and the policies differ) and --threads; --clients client threads, in this process, each send --requests
streamed completions (greedy, --max-tokens) whose prompts interleave the held-out parts of austen, pydocs and
foldoc (client i's request j takes domain (i + j) mod 3).

Per request, measured by the client: TTFT (from sending to the first streamed text) and TPOT ((last text - first
text) / (tokens - 1)); p50 and p99 over all requests. From the server's /metrics after the run: expert-cache hit
rate, bytes moved into the cache, 5xx answers, its peak resident set and the resident set at start (before the
artifact: interpreter and libraries) against --memory. The server and the clients share this machine's cores, as a
local server does; every number is of this machine (named in the results' provenance).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
DOMAINS = ("austen", "pydocs", "foldoc")
PROMPT_WORDS = 48


def artifact_for(name: str, work: Path) -> Path:
    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import Calibration
    from hexq.config.recipe_files import load_recipe
    from hexq.pack.stage import Budget, pack

    out = work / f"{name}-3.0-online.hexq"
    if not (out / "manifest.json").exists():
        calib = work / f"{name}-mixed"
        if not (calib / "manifest.json").exists():
            recipe = load_recipe("experts-mixed")
            recipe = type(recipe)(**{**recipe.__dict__,
                                     "calibration": Calibration(num_samples=32, seqlen=256, seed=0)})
            calibrate(MODELS[name], recipe, "bundled", calib)
        pack(calib, out, budget=Budget(avg_bits=3.0), overwrite=True, bank=("online",))
    return out


def expert_bytes(artifact: Path) -> int:
    """Bytes of every expert at its allocated width, as the packed cache holds it."""
    from hexq.artifact.reader import Artifact

    opened = Artifact(artifact)
    try:
        return sum(span.end - span.start for row, widths in enumerate(opened.allocation)
                   for expert, bits in enumerate(widths) if bits for span in opened.expert_spans(row, expert, bits))
    finally:
        opened.close()


def prompts(count: int) -> dict[str, list[str]]:
    """`count` prompts of PROMPT_WORDS words per domain, cut from its held-out text."""
    from hexq.base.data import corpus_text

    out = {}
    for domain in DOMAINS:
        words = corpus_text(domain, "heldout").split()
        step = max(PROMPT_WORDS, (len(words) - PROMPT_WORDS) // count)
        out[domain] = [" ".join(words[i * step:i * step + PROMPT_WORDS]) for i in range(count)]
    return out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(artifact: Path, options: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "hexq_cli.main", "serve", str(artifact), "--port", str(port),
                                *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"hexq serve exited: {process.stdout.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("hexq serve did not start in 300 s")


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT, TPOT and tokens as the client sees them."""
    sent = time.perf_counter()
    times: list[float] = []
    tokens = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            return {"status": response.status_code}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    out = {"status": 200, "tokens": tokens}
    if times:
        out["ttft"] = times[0] - sent
        if tokens > 1:
            out["tpot"] = (times[-1] - times[0]) / (tokens - 1)
    return out


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_load(url: str, texts: dict[str, list[str]], clients: int, requests: int, max_tokens: int) -> list[dict]:
    results: list[dict] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for request in range(requests):
            domain = DOMAINS[(index + request) % len(DOMAINS)]
            prompt = texts[domain][(index * requests + request) % len(texts[domain])]
            try:
                outcome = one_request(url, prompt, max_tokens)
            except httpx.HTTPError as exc:
                outcome = {"status": None, "error": repr(exc)}
            with lock:
                results.append(outcome | {"domain": domain})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def measure(name: str, policy: str, args, texts) -> dict:
    artifact = artifact_for(name, args.work)
    budget = int(expert_bytes(artifact) * args.budget_share)
    options = ["--policy", policy, "--fast-tier", str(budget), "--threads", str(args.threads)]
    process, url = start_server(artifact, options)
    try:
        started = time.perf_counter()
        results = run_load(url, texts, args.clients, args.requests, args.max_tokens)
        seconds = time.perf_counter() - started
        metrics = scrape(url)
    finally:
        process.terminate()
        process.wait(timeout=60)
    answered = [r for r in results if r["status"] == 200]
    ttft = [r["ttft"] for r in answered if "ttft" in r]
    tpot = [r["tpot"] for r in answered if "tpot" in r]
    server_errors = sum(v for k, v in metrics.items() if k.startswith("hexq_requests_total") and 'status="5' in k)
    hits, misses = metrics.get("hexq_cache_hits_total", 0), metrics.get("hexq_cache_misses_total", 0)
    return {"model": name, "policy": policy, "requests": len(results), "answered": len(answered),
            "server_errors": int(server_errors), "seconds": seconds,
            "tokens_per_second": sum(r["tokens"] for r in answered) / seconds,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
            "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
            "cache_bytes_moved": metrics.get("hexq_cache_bytes_moved_total"), "budget_bytes": budget,
            "peak_rss_bytes": metrics.get("hexq_peak_rss_bytes"),
            "startup_rss_bytes": metrics.get("hexq_startup_rss_bytes")}


HEADER = ("| model | policy | answered | 5xx | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | tokens/s | cache hit rate "
          "| peak RSS MiB (since start) |\n|---|---|---|---|---|---|---|---|---|")


def show(row: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.1f}"

    rate = "-" if row["cache_hit_rate"] is None else f"{row['cache_hit_rate']:.1%}"
    grown = (row["peak_rss_bytes"] - row["startup_rss_bytes"]) / 2**20
    return (f"| {row['model']} | {row['policy']} | {row['answered']}/{row['requests']} | {row['server_errors']} | "
            f"{ms(row['ttft_p50'])} / {ms(row['ttft_p99'])} | {ms(row['tpot_p50'])} / {ms(row['tpot_p99'])} | "
            f"{row['tokens_per_second']:.1f} | {rate} | {row['peak_rss_bytes'] / 2**20:.0f} ({grown:+.0f}) |")


def render(results: dict) -> str:
    setup = results["setup"]
    return "\n".join([f"{setup['clients']} clients x {setup['requests']} streamed requests of {setup['max_tokens']} "
                      f"greedy tokens, austen / pydocs / foldoc prompts interleaved; expert cache "
                      f"{setup['budget_share']:.0%} of the experts' bytes; {setup['threads']} kernel threads",
                      HEADER, *(show(row) for row in results["rows"])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--policies", nargs="+", default=["static", "online"])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-share", type=float, default=0.5, help="expert cache / every expert's bytes")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve.json")
    args = parser.parse_args()
    run = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    texts = prompts(args.clients * args.requests)
    rows: list[dict] = []
    setup = {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
             "budget_share": args.budget_share, "threads": args.threads}
    print(HEADER, flush=True)
    for name in args.models:
        for policy in args.policies:
            row = measure(name, policy, args, texts)
            rows.append(row)
            print(show(row), flush=True)
            write_results(args.out, {"setup": setup, "rows": rows}, run)
    write_results(args.out, {"setup": setup, "rows": rows}, run, complete=True)
    return 0 if all(r["answered"] == r["requests"] and not r["server_errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
