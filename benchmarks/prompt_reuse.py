"""A chat's next turn with and without prompt reuse (hexq.runtime.prefix): the time to its first token.

    python benchmarks/prompt_reuse.py --artifact benchmarks/work/engines/hexq-3.hexq
    python benchmarks/prompt_reuse.py --artifact A --history 600 1200 2400 --turn 64 --repeats 3

For each history length H, on one runtime (the native decode step, --threads): a first request of H tokens (random
ids, 4 generated), then the next turn, the same H tokens and --turn more, generating 4 tokens. The next turn is timed
right after the first request (reuse: the runtime takes whole prefill passes of the history from its KV cache, the
rest of the history and the turn prefilled: history lengths off the pass length show what a chat gets) and
again with the runtime's previous prompt forgotten (fresh), taking turns --repeats times; TTFT = from the call to
the first token (the prefill of what is not reused, and the head), the median of each. Both must give the same tokens
(checked every time). A real-shaped artifact (benchmarks/engines.py makes one: benchmarks/work/engines/hexq-3.hexq)
shows what a CPU's prefill costs; every number is of this machine, named in the results' provenance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hexq.runtime.engine import PREFILL_CHUNK, Runtime

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent


def next_turn(runtime: Runtime, history: list[int], turn: list[int], fresh: bool) -> tuple[float, list[int], int]:
    """(TTFT seconds, tokens, reused positions) of the turn after `history`, the history's request served first."""
    list(runtime.tokens(history, 4))
    if fresh:
        runtime.native.prompt = []
    started = time.perf_counter()
    tokens = runtime.tokens(history + turn, 4)
    first = next(tokens)
    seconds = time.perf_counter() - started
    return seconds, [first, *tokens], runtime.reused


def measure(runtime: Runtime, length: int, turn_length: int, repeats: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(length)
    history = torch.randint(1, vocab, (length,), generator=generator).tolist()
    turn = torch.randint(1, vocab, (turn_length,), generator=generator).tolist()
    times: dict[bool, list[float]] = {True: [], False: []}
    reused = 0
    for _ in range(repeats):
        for fresh in (True, False):
            seconds, tokens, positions = next_turn(runtime, history, turn, fresh)
            times[fresh].append(seconds)
            if fresh:
                want = tokens
            else:
                reused = positions
                if tokens != want:
                    raise SystemExit(f"history {length}: the reused turn generated {tokens}, the fresh one {want}")
    fresh, kept = statistics.median(times[True]), statistics.median(times[False])
    print(f"history {length} + {turn_length}: TTFT fresh {fresh * 1000:.0f} ms, reused {kept * 1000:.0f} ms "
          f"({reused} positions reused): {fresh / kept:.2f}x", flush=True)
    return {"history": length, "turn": turn_length, "reused": reused, "ttft_fresh": fresh, "ttft_reused": kept,
            "speedup": fresh / kept}


def render(results: dict) -> str:
    lines = [f"A chat's next turn (--turn {results['turn']} new tokens after the history), {results['threads']} "
             f"threads, {results['artifact']}; TTFT median of {results['repeats']} each, the two taking turns",
             "| history (tokens) | positions reused | TTFT fresh (ms) | TTFT reused (ms) | fresh / reused |",
             "|---|---|---|---|---|"]
    lines += [f"| {row['history']} | {row['reused']} | {row['ttft_fresh'] * 1000:.0f} | "
              f"{row['ttft_reused'] * 1000:.0f} | {row['speedup']:.2f}x |" for row in results["rows"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--history", type=int, nargs="+", default=[600, 1200, 2400])
    parser.add_argument("--turn", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "prompt_reuse.json")
    args = parser.parse_args()
    run = start_run(args)
    torch.set_num_threads(args.threads)
    results = {"benchmark": "prompt_reuse", "artifact": args.artifact.name, "turn": args.turn,
               "repeats": args.repeats, "threads": args.threads, "prefill_chunk": PREFILL_CHUNK, "rows": []}
    context = max(args.history) + args.turn + 4
    with Runtime(args.artifact, threads=args.threads, decode="native", context=context) as runtime:
        vocab = runtime.model.config.vocab_size
        for length in args.history:
            results["rows"].append(measure(runtime, length, args.turn, args.repeats, vocab))
            write_results(args.out, results, run)
    write_results(args.out, results, run, complete=True)
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
