"""`jaxnn serve` under load: output tokens/s, and the p50/p99 time to the first token and per output token, at
several concurrencies; the same server holding one request at a time (`--slots 1`), and transformers' `generate`
on the same prompts, side by side.

    python -m benchmarks.serve [--size gpt2-small|small] [--concurrency 1 4 16 64] [--prompt 64] [--new-tokens 64]
        [--in-process] [--no-transformers] [--json out.json]

The model is GPT-2-small-shaped by default (random weights, fp32, `benchmarks.generation`'s), written as a
transformers folder with a word-level tokenizer of its 50257 ids and no end token, so every request produces
exactly `--new-tokens` tokens. Each concurrency runs one untimed round (compiling its prefill and decode programs),
then a timed round of 2 x concurrency streamed requests sent by that many client threads over loopback HTTP; a
request's time to first token runs from its sending to its first text, its time per output token from there to
its last over the tokens between. transformers' `generate` runs the same prompts one at a time (batch 1, greedy,
with its cache), its usual use, and as one padded batch of 16. `--in-process` drives the engine in this process
without HTTP (no server stack needed: the GPU row of `make gpu-check`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np

from benchmarks.generation import SIZES, cpu_name, to_transformers
from benchmarks.output import add_json_flags, refuse_existing
from jaxnn.layers import init_model
from jaxnn.models import GPT, GPTConfig


def write_folder(folder: pathlib.Path, cfg: GPTConfig, params: Any) -> pathlib.Path:
    """The model as a transformers folder, with a word-level tokenizer of its whole vocabulary."""
    import tokenizers

    from jaxnn.interop.hf import save_hf

    save_hf(folder, cfg, params)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


class Server:
    """A `jaxnn serve` process on a free loopback port."""

    def __init__(self, folder: pathlib.Path, slots: int, context: int, prompt_tokens: int):
        argv = [sys.executable, "-m", "jaxnn.cli", "serve", str(folder), "--port", "0", "--slots", str(slots),
                "--context", str(context), "--max-queue", "1024", "--warm-up", str(prompt_tokens),
                "--log-level", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:  # type: ignore[union-attr]
            found = re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", line)
            if found:
                self.port = int(found.group(1))
                threading.Thread(target=lambda: list(self.proc.stderr), daemon=True).start()  # never a full pipe
                return
        raise RuntimeError("benchmarks.serve: the server exited before listening")

    def stream(self, prompt: list[int], new_tokens: int) -> dict[str, float]:
        """One streamed completion: its time to first text, time per output token, and token count."""
        body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}})  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        first = last = None
        tokens = 0
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
        connection.close()
        assert first is not None and last is not None, "benchmarks.serve: a request produced no text"
        return {"ttft": first - start, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


class InProcess:
    """The same load on `jaxnn.serve`'s engine in this process, without HTTP: what the device and the batching
    give on their own (the GPU machine has no server stack installed, and this is the row `make gpu-check` adds)."""

    def __init__(self, cfg: GPTConfig, params: Any, slots: int, context: int, prompt_tokens: int):
        from jaxnn.serve.engine import Engine

        self.engine = Engine(GPT(cfg), params, context=context, slots=slots, max_queue=1024)
        self.engine.warm_up([prompt_tokens])
        self.engine.start()

    def stream(self, prompt: list[int], new_tokens: int) -> dict[str, float]:
        """One request: its time to first token, time per output token, and token count."""
        from jaxnn.serve.engine import Request

        times: list[float] = []
        done = threading.Event()

        def on_token(token: int | None, finish: str | None) -> None:
            times.append(time.perf_counter())
            if finish is not None:
                done.set()

        start = time.perf_counter()
        self.engine.submit(Request(prompt, new_tokens, on_token))
        done.wait()
        return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / max(len(times) - 1, 1),
                "tokens": len(times)}  # fmt: skip

    def stop(self) -> None:
        self.engine.stop()


def load_round(
    server: Server | InProcess, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict[str, float]:
    """`prompts` sent by `concurrency` client threads; throughput and latency percentiles (ms)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: server.stream(p, new_tokens), prompts))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results]
    return {
        "requests": len(results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "tpot_p50_ms": _percentile(tpot, 50),
        "tpot_p99_ms": _percentile(tpot, 99),
    }


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def serve_rows(start_server, prompts_for, concurrencies, new_tokens, slots: int | None, name: str) -> list[dict]:
    """One row per concurrency against a fresh `start_server(slots)` (`slots`: None gives it as many slots as the
    concurrency)."""
    rows = []
    for c in concurrencies:
        server = start_server(slots or c)
        try:
            load_round(server, prompts_for(c), new_tokens, c)  # compiles this concurrency's programs
            row = load_round(server, prompts_for(2 * c), new_tokens, c)
        finally:
            server.stop()
        rows.append({"server": name if slots is None else f"{name} --slots {slots}", "concurrency": c, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def transformers_rows(cfg: GPTConfig, params: Any, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers' greedy `generate`: the prompts one at a time, then as one padded batch of 16."""
    try:
        import torch
    except ImportError:
        return []
    hf = to_transformers(cfg, params)
    rows = []
    for batch in (1, 16):
        chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        with torch.no_grad():
            run = lambda rows_: hf.generate(torch.tensor(rows_), max_new_tokens=new_tokens,  # noqa: E731
                                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            run(chunks[0])  # warm-up
            start = time.perf_counter()
            for chunk in chunks:
                run(chunk)
            wall = time.perf_counter() - start
        row = {"server": f"transformers generate, batch {batch}", "concurrency": batch,
               "requests": len(prompts), "tokens_per_s": len(prompts) * new_tokens / wall}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="drive the engine directly, without HTTP")
    add_json_flags(parser)
    args = parser.parse_args()
    refuse_existing(args.json, overwrite=args.overwrite)
    cfg = SIZES[args.size]
    context = args.prompt + args.new_tokens
    if context > cfg.seq_len:
        parser.error(f"--prompt + --new-tokens ({context}) exceed the model's {cfg.seq_len} positions")
    params = init_model(GPT(cfg), jax.random.key(0), (1, 8))[1]
    rng = np.random.default_rng(0)
    pool = [[int(t) for t in rng.integers(1, cfg.vocab_size, args.prompt)] for _ in range(2 * max(args.concurrency))]
    prompts_for = lambda n: pool[:n]  # noqa: E731
    one_at_a_time = [min(16, max(args.concurrency))]  # the goal's concurrency, where it was measured
    with tempfile.TemporaryDirectory() as tmp:
        if args.in_process:
            start, name = (lambda slots: InProcess(cfg, params, slots, context, args.prompt)), "jaxnn engine (no HTTP)"
        else:
            folder = write_folder(pathlib.Path(tmp) / "model", cfg, params)
            start, name = (lambda slots: Server(folder, slots, context, args.prompt)), "jaxnn serve"
        rows = serve_rows(start, prompts_for, args.concurrency, args.new_tokens, None, name)
        rows += serve_rows(start, prompts_for, one_at_a_time, args.new_tokens, 1, name)
    if not args.no_transformers:
        rows += transformers_rows(cfg, params, pool[:32], args.new_tokens)
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "size": args.size, "in_process": args.in_process,
              "prompt": args.prompt, "new_tokens": args.new_tokens, "rows": rows}  # fmt: skip
    print(table(rows))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def table(rows: list[dict]) -> str:
    lines = [
        "| server | concurrency | tokens/s | TTFT p50 / p99 (ms) | per token p50 / p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}" if "ttft_p50_ms" in r else "-"
        tpot = f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}" if "tpot_p50_ms" in r else "-"
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {ttft} | {tpot} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
