"""Prefix caching benchmark: a 12-turn chat, a repeated long prompt and a shared system prompt, on and off.

Each turn sends the whole conversation so far plus ~60 new tokens (as every chat client does) and
streams a short greedy reply; TTFT per turn shows whether the server recomputes the history. Then the
same 1,200-token prompt twice; then 32 chats at concurrency 16 that share a ~500-token system prompt
and ask distinct ~50-token questions (aggregate output tok/s). Both servers run the default config in
turn, differing only in `engine.enable_prefix_caching`.

    python -m bench.multiturn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from bench.harness import (ServerProcess, check_out, int_at_least, machine_facts, nonnegative_int, positive_int,
                           run_cli, run_client, write_config)
from server.config import DEFAULT_CONFIG, load_config
from server.fileio import write_json_atomic

RESULTS = Path(__file__).parent / "results"
WORDS = ("river stone lantern orbit meadow copper signal harbor violet engine quiet summit ledger canvas "
         "thunder pocket garden mirror falcon candle marble winter saddle comet velvet anchor").split()


def user_turn(rng: random.Random, num_words: int = 45) -> str:
    """About 60 tokens of plain words."""
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."


def streamed_ttft(client: httpx.Client, url: str, path: str, body: dict) -> tuple[float, str, dict]:
    """(seconds to the first streamed token, the full text, usage) of one request."""
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{url}{path}", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choice = (chunk.get("choices") or [{}])[0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
    return ttft or float("nan"), "".join(text), usage


async def shared_prefix_throughput(url: str, model: str, rng: random.Random, num: int = 32, concurrency: int = 16,
                                   max_tokens: int = 32) -> float:
    """Aggregate output tok/s of chats sharing a ~500-token system prompt, distinct ~50-token questions."""
    system = {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(380))}
    questions = [user_turn(rng, 36) for _ in range(num)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(question: str) -> int:
            async with sem:
                body = {"model": model, "messages": [system, {"role": "user", "content": question}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                return (await client.post(f"{url}/v1/chat/completions", json=body)).json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(q) for q in questions))
    return sum(tokens) / (time.perf_counter() - start)


def run_server(config: Path, model: str, turns: int, long_prompt_words: int, seed: int) -> dict:
    """TTFT of every chat turn and of the repeated long prompt, against one server."""
    rng = random.Random(seed)
    with ServerProcess(config, RESULTS / f"multiturn-{config.stem}.log") as server, httpx.Client(timeout=300) as client:
        server.wait_ready()
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        turn_ttfts, prompt_tokens, computed = [], [], []
        for _ in range(turns):
            messages.append({"role": "user", "content": user_turn(rng)})
            ttft, reply, usage = streamed_ttft(client, server.url, "/v1/chat/completions",
                                               {"model": model, "messages": messages, "max_tokens": 16,
                                                "temperature": 0})
            messages.append({"role": "assistant", "content": reply})
            turn_ttfts.append(ttft)
            prompt_tokens.append(usage["prompt_tokens"])
            computed.append(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])
        prompt = " ".join(rng.choice(WORDS) for _ in range(long_prompt_words))
        repeat = [streamed_ttft(client, server.url, "/v1/completions",
                                {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})[0]
                  for _ in range(2)]
        shared_tok_s = run_client(shared_prefix_throughput(server.url, model, rng))
        hits = server.metric("neuronmm_prefix_cache_hits_total")
        queries = server.metric("neuronmm_prefix_cache_queries_total")
    return {"turn_ttft_ms": [1e3 * t for t in turn_ttfts], "turn_prompt_tokens": prompt_tokens,
            "turn_computed_tokens": computed, "repeat_ttft_ms": [1e3 * t for t in repeat],
            "shared_prefix_tok_s": shared_tok_s,
            "prefix_hit_rate": hits / queries if queries else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.multiturn", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    # the report compares the last turn with the second: two at least
    p.add_argument("--turns", type=int_at_least(2), default=12)
    p.add_argument("--long-prompt-words", type=positive_int, default=900, help="~1,200 tokens")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", default=str(RESULTS / "multiturn.json"))
    args = p.parse_args(argv)
    out = check_out(args.out, markdown=False)
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = load_config(args.config).model.name
    report = {**machine_facts(), "config": args.config, "runs": {}}
    for caching in (True, False):
        path = write_config(RESULTS / f"multiturn-caching-{'on' if caching else 'off'}.yaml", None,
                            engine={"enable_prefix_caching": caching}, base=Path(args.config))
        run = run_server(path, model, args.turns, args.long_prompt_words, args.seed)
        report["runs"]["on" if caching else "off"] = run
        t = run["turn_ttft_ms"]
        print(f"prefix caching {'on ' if caching else 'off'}: turn TTFT ms {' '.join(f'{x:.0f}' for x in t)}; "
              f"last/second {t[-1] / t[1]:.2f}; repeated long prompt {run['repeat_ttft_ms'][0]:.0f} -> "
              f"{run['repeat_ttft_ms'][1]:.0f} ms; shared system prompt c=16 {run['shared_prefix_tok_s']:.1f} tok/s; "
              f"prefix hit rate {run['prefix_hit_rate']:.2f}; prompt tokens "
              f"{run['turn_prompt_tokens']}, computed {run['turn_computed_tokens']}", flush=True)
    write_json_atomic(out, report)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
