"""Speculative decoding against plain decoding, the engine in-process, one request at a time (or --concurrency of
them): output tokens/s on replies that copy from their prompt (BoolQ passages to repeat with a change), and on
replies that do not (questions answered freely), greedy (or --temperature), the variants alternating round by round.

    python -m bench.speculative [--rounds 3] [--prompts 6] [--max-tokens 128] [--concurrency 1] [--predicted]

The default model and config (dtype auto). Variants: "plain"; "ngram", an engine that adds `{"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`; with --predicted also "predicted",
the plain engine with each request predicting its reply (OpenAI's Predicted Outputs): the passage for the copy
workload, and for the free one the same passage, a prediction its reply does not follow. Every greedy reply is
compared token for token with the plain one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pydantic import ValidationError

from bench.harness import check_out, machine_facts, nonnegative_float, positive_int, publish, run_cli
from server.config import SpeculativeConfig, data_dir, load_config
from server.engine.sampling_params import SamplingParams
from server.errors import first_error
from server.runtime import load_runtime

RESULTS = Path(__file__).parent / "results"


def workloads(tokenizer, num_prompts: int) -> tuple[dict[str, list[list[int]]], list[list[int]]]:
    """Chat prompts whose reply copies a passage ("copy"), and ones whose reply is free ("free"); the passages'
    tokens (a prediction of the copy)."""
    boolq = data_dir() / "boolq" / "val.jsonl"
    rows = [json.loads(line) for line in boolq.read_text().splitlines()[:num_prompts]]

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)

    passages = [r["passage"].split(" -- ", 1)[-1][:600] for r in rows]
    return ({"copy": [chat(f"Repeat this text word for word, but in the past tense:\n\n{p}") for p in passages],
             "free": [chat(f"Answer in a few sentences: {r['question']}?") for r in rows]},
            [tokenizer.encode(p, add_special_tokens=False) for p in passages])


def run(engine, prompts: list[list[int]], max_tokens: int, concurrency: int, temperature: float,
        predictions: list[list[int]] | None = None) -> tuple[float, list[list[int]], int, int]:
    """(seconds, each reply's tokens, draft tokens, accepted) for the prompts, `concurrency` of them in flight
    (each with its predicted reply, where given)."""
    if concurrency < 1:  # no request would ever be added: the loop would spin forever
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    steps = []
    engine.observers.append(steps.append)
    replies = {f"r{i}": [] for i in range(len(prompts))}
    queue = list(enumerate(prompts))
    start, in_flight = time.perf_counter(), set()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            i, ids = queue.pop(0)
            engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                                            prediction=predictions[i] if predictions else None))
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
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--prompts", type=positive_int, default=6)
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--draft-tokens", type=positive_int, default=4)
    parser.add_argument("--concurrency", type=positive_int, default=1, help="requests in flight (1: one at a time)")
    parser.add_argument("--temperature", type=nonnegative_float, default=0.0,
                        help="0: greedy (replies compared token for token); above: sampled, seeded per prompt")
    parser.add_argument("--predicted", action="store_true", help="also the plain engine with predicted replies")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sampled = f"-t{args.temperature:g}" if args.temperature else ""
    predicted = "-predicted" if args.predicted else ""
    args.out = check_out(args.out or RESULTS / f"speculative{predicted}-c{args.concurrency}{sampled}.json")

    try:  # the config's bounds on the draft, checked before any engine loads
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.draft_tokens)
    except ValidationError as exc:
        parser.error(f"--draft-tokens: {first_error(exc)}")
    plain_cfg = load_config(None)
    spec_cfg = load_config(None, {"engine.speculative": spec.model_dump()})
    plain = load_runtime(plain_cfg).engine
    work, passages = workloads(plain.tokenizer, args.prompts)
    # variant -> (engine, its requests' predicted replies)
    variants = {"plain": (plain, None), "ngram": (load_runtime(spec_cfg).engine, None)}
    if args.predicted:
        variants["predicted"] = (plain, passages)
    times = {(v, w): [] for v in variants for w in work}
    tokens, drafts, replies = {}, {}, {}
    for _ in range(args.rounds):
        for name, (engine, predictions) in variants.items():
            for kind, prompts in work.items():
                seconds, got, made, held = run(engine, prompts, args.max_tokens, args.concurrency, args.temperature,
                                               predictions)
                times[(name, kind)].append(seconds)
                tokens[(name, kind)] = sum(len(r) for r in got)
                drafts[(name, kind)] = (made, held)
                replies[(name, kind)] = got
    rows, md = [], ["| workload | variant | tok/s | speed-up | drafted / accepted tokens | replies equal to plain |",
                    "|---|---|---:|---:|---:|---:|"]
    for kind in work:
        plain_rate = tokens[("plain", kind)] / statistics.median(times[("plain", kind)])
        for name in variants:
            rate = tokens[(name, kind)] / statistics.median(times[(name, kind)])
            equal = (sum(a == b for a, b in zip(replies[("plain", kind)], replies[(name, kind)]))
                     if not args.temperature else None)  # sampled: the same distribution, other draws
            made, held = drafts[(name, kind)]
            rows.append({"workload": kind, "variant": name, "tok_s": rate, "speedup": rate / plain_rate,
                         "draft_tokens": made, "accepted_tokens": held, "replies_equal": equal,
                         "replies": len(work[kind]), "seconds": times[(name, kind)]})
            md.append(f"| {kind} | {name} | {rate:.1f} | {rate / plain_rate:.2f} x | {made} / {held} | "
                      f"{'-' if equal is None else f'{equal} / {len(work[kind])}'} |")
    report = {"machine": machine_facts(), "args": {k: str(v) for k, v in vars(args).items()},
              "speculative": spec.model_dump(), "rows": rows}
    return publish(args.out, report, "\n".join(md))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
