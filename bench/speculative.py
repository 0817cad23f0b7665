"""n-gram speculative decoding (`engine.speculative`) against plain decoding, the engine in-process, one request at
a time (or --concurrency of them): output tokens/s on replies that copy from their prompt (BoolQ passages to
repeat with a change), and on replies that do not (questions answered freely), greedy (or --temperature), the
two engines alternating round by round.

    python -m bench.speculative [--rounds 3] [--prompts 6] [--max-tokens 128] [--concurrency 1]

The default model and config (dtype auto); the speculative engine adds `{"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`. Every greedy reply is compared
token for token between the two engines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.harness import machine_facts, publish
from server.config import SpeculativeConfig, data_dir, load_config
from server.engine.sampling_params import SamplingParams
from server.runtime import load_runtime

RESULTS = Path(__file__).parent / "results"


def workloads(tokenizer, num_prompts: int) -> dict[str, list[list[int]]]:
    """Chat prompts whose reply copies a passage ("copy"), and ones whose reply is free ("free")."""
    boolq = data_dir() / "boolq" / "val.jsonl"
    rows = [json.loads(line) for line in boolq.read_text().splitlines()[:num_prompts]]

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)

    passages = [r["passage"].split(" -- ", 1)[-1][:600] for r in rows]
    return {"copy": [chat(f"Repeat this text word for word, but in the past tense:\n\n{p}") for p in passages],
            "free": [chat(f"Answer in a few sentences: {r['question']}?") for r in rows]}


def run(engine, prompts: list[list[int]], max_tokens: int, concurrency: int,
        temperature: float) -> tuple[float, list[list[int]], int, int]:
    """(seconds, each reply's tokens, draft tokens, accepted) for the prompts, `concurrency` of them in flight."""
    steps = []
    engine.observers.append(steps.append)
    replies = {f"r{i}": [] for i in range(len(prompts))}
    queue = list(enumerate(prompts))
    start, in_flight = time.perf_counter(), set()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            i, ids = queue.pop(0)
            engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))
            in_flight.add(f"r{i}")
        for out in engine.step():
            replies[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                in_flight.discard(out.request_id)
    seconds = time.perf_counter() - start
    engine.observers.remove(steps.append)
    got = [replies[f"r{i}"] for i in range(len(prompts))]
    return seconds, got, sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (1: one at a time)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (replies compared token for "
                                                                       "token); above: sampled, seeded per prompt")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sampled = f"-t{args.temperature:g}" if args.temperature else ""
    args.out = args.out or RESULTS / f"speculative-c{args.concurrency}{sampled}.json"

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.draft_tokens)
    plain_cfg = load_config(None)
    spec_cfg = load_config(None, {"engine.speculative": spec.model_dump()})
    engines = {"plain": load_runtime(plain_cfg).engine, "ngram": load_runtime(spec_cfg).engine}
    work = workloads(engines["plain"].tokenizer, args.prompts)
    times = {(e, w): [] for e in engines for w in work}
    tokens, drafts, replies = {}, {}, {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for kind, prompts in work.items():
                seconds, got, made, held = run(engine, prompts, args.max_tokens, args.concurrency, args.temperature)
                times[(name, kind)].append(seconds)
                tokens[(name, kind)] = sum(len(r) for r in got)
                drafts[(name, kind)] = (made, held)
                replies[(name, kind)] = got
    rows, md = [], ["| workload | plain tok/s | ngram tok/s | speed-up | drafted / accepted tokens | replies equal |",
                    "|---|---:|---:|---:|---:|---:|"]
    for kind in work:
        rate = {e: tokens[(e, kind)] / statistics.median(times[(e, kind)]) for e in engines}
        equal = (sum(a == b for a, b in zip(replies[("plain", kind)], replies[("ngram", kind)]))
                 if not args.temperature else None)  # sampled: the same distribution, other draws
        made, held = drafts[("ngram", kind)]
        rows.append({"workload": kind, "plain_tok_s": rate["plain"], "ngram_tok_s": rate["ngram"],
                     "speedup": rate["ngram"] / rate["plain"], "draft_tokens": made, "accepted_tokens": held,
                     "replies_equal": equal, "replies": len(work[kind]), "seconds": {f"{e}": times[(e, kind)]
                                                                                     for e in engines}})
        md.append(f"| {kind} | {rate['plain']:.1f} | {rate['ngram']:.1f} | {rate['ngram'] / rate['plain']:.2f} x | "
                  f"{made} / {held} | {'-' if equal is None else f'{equal} / {len(work[kind])}'} |")
    report = {"machine": machine_facts(), "args": {k: str(v) for k, v in vars(args).items()},
              "speculative": spec.model_dump(), "rows": rows}
    return publish(args.out, report, "\n".join(md))


if __name__ == "__main__":
    raise SystemExit(main())
