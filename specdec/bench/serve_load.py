"""serve_load: `specdec serve` under 1, 4 and 16 concurrent clients, speculation off / fixed γ / adaptive.

Each mode runs its own server subprocess (the real CLI, on a free loopback port); each client sends
its requests one after another as streamed chat completions (EOS ignored, so every request has the
same length). Throughput = completion tokens of all requests / wall time of the level; TTFT and TPOT
per request, P50/P95/P99; acceptance from the server's Prometheus counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.dataset import load_prompts
from specdec.bench.report import environment_line, publish
from specdec.models.zoo import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

MODES = ("off", "fixed", "adaptive")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench serve_load", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--gamma", type=int, default=4, help="γ of the fixed mode, the most the adaptive mode drafts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--datasets", nargs="+", default=["chat", "code"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds (a first run converts weights)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/serve_load"))
    parser.add_argument("--update", type=Path, default=None, help="rewrite this Markdown file's serve_load section")
    args = parser.parse_args(argv)
    prompts = [p["prompt"] for name in args.datasets for p in load_prompts(name)]
    results = []
    for mode in args.modes:
        with _Server(args, mode) as server:
            server.warm_up(prompts[0])
            for concurrency in args.concurrency:
                before = server.spec_counters()
                level = asyncio.run(_load(server, prompts, concurrency, args))
                after = server.spec_counters()
                level.update(mode=mode, concurrency=concurrency,
                             **{k: after[k] - before[k] for k in after})
                results.append(level)
                print(f"{mode} ×{concurrency}: {level['tok_per_s']:.1f} tok/s", flush=True)
    publish("serve_load", results, _table(results, args, argv), args.out, args.update)
    return 0


class _Server:
    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        self.args, self.mode = args, mode
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "_Server":
        args = self.args
        command = [sys.executable, "-m", "specdec.cli", "serve", args.model, "--port", str(self.port),
                   "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", "bench"]
        config = "none"
        if self.mode != "off":
            config = json.dumps({"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.gamma,
                                 "adaptive": self.mode == "adaptive"})
        command += ["--speculative-config", config]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        import httpx

        deadline = time.time() + args.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.mode} server exited: {self.process.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the {self.mode} server did not start within {args.startup_timeout} s")
            time.sleep(1)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def warm_up(self, prompt: str) -> None:
        asyncio.run(_request(self, prompt, self.args, 8))

    def spec_counters(self) -> dict[str, float]:
        import httpx

        names = {"draft_tokens": "specdec:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "specdec:spec_decode_num_accepted_tokens_total",
                 "drafts": "specdec:spec_decode_num_drafts_total"}
        values = dict.fromkeys(names, 0.0)
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            for key, name in names.items():
                if line.startswith(name + "{"):
                    values[key] += float(line.rsplit(" ", 1)[1])
        return values


async def _request(server: _Server, prompt: str, args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with httpx.AsyncClient(timeout=None) as client:
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                    first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft_s": first - start, "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens}


async def _load(server: _Server, prompts: list[str], concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    async def client(index: int) -> list[dict[str, Any]]:
        done = []
        for k in range(args.requests_per_client):
            prompt = prompts[(index * args.requests_per_client + k) % len(prompts)]
            done.append(await _request(server, prompt, args, args.max_tokens))
        return done

    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    requests = [r for rs in per_client for r in rs]
    tokens = sum(r["tokens"] for r in requests)
    return {"requests": requests, "wall_s": wall, "tok_per_s": tokens / wall,
            "ttft_s": _percentiles([r["ttft_s"] for r in requests]),
            "tpot_s": _percentiles([r["tpot_s"] for r in requests if r["tpot_s"] is not None])}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p95": cuts[94], "p99": cuts[98]}


def _table(results: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str]) -> str:
    def ms(stats: dict[str, float | None]) -> str:
        return " / ".join("—" if stats[k] is None else f"{stats[k] * 1000:.0f}" for k in ("p50", "p95", "p99"))

    off = {r["concurrency"]: r["tok_per_s"] for r in results if r["mode"] == "off"}
    lines = [
        "## Serving under load: speculation off / fixed / adaptive",
        "",
        f"Command: `specdec bench serve_load {' '.join(argv)}`  ",
        f"`specdec serve {args.model}` (draft {args.draft}; fixed γ = {args.gamma}, adaptive γ ≤ {args.gamma}), "
        f"each client sending {args.requests_per_client} streamed chat requests in turn ({', '.join(args.datasets)} "
        f"prompts), {args.max_tokens} tokens each (EOS ignored), temperature {args.temperature}, "
        f"`--max-num-seqs` = the largest concurrency. One run. {environment_line()}",
        "",
        "| mode | clients | tok/s | ÷ off | TTFT ms P50 / P95 / P99 | TPOT ms P50 / P95 / P99 | acceptance | "
        "mean accepted length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['tok_per_s'] / off[r['concurrency']]:.2f}×" if r["concurrency"] in off else "—"
        acceptance = f"{r['accepted_tokens'] / r['draft_tokens']:.2f}" if r["draft_tokens"] else "—"
        length = f"{1 + r['accepted_tokens'] / r['drafts']:.2f}" if r["drafts"] else "—"
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tok_per_s']:.1f} | {ratio} | {ms(r['ttft_s'])} | "
                     f"{ms(r['tpot_s'])} | {acceptance} | {length} |")
    return "\n".join(lines)
