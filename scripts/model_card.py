"""Measure a trained reference model and write its model card (README.md + card.json in the model folder).

    python scripts/model_card.py models/hexq-tiny-qwen3moe

Measures, all with the GPTQ perplexity protocol (window 256, non-overlapping, remainder dropped):
- full-precision perplexity on the held-out tails of austen/pydocs/foldoc and on WikiText-2 (all windows);
- per-layer expert load on the held-out text (share of routed slots per expert; never-used experts);
- RTN weight quantization (symmetric, per output channel; attention + experts; router, embeddings, norms
  and LM head kept) at 8, 4, 3 and 2 bits, on the first `--rtn-windows` windows of each text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hexq.algos.quant import QuantSpec
from hexq.base.data import TRAIN_CORPORA, eval_text, tokenize
from hexq.base.io import write_bytes_atomic, write_json_atomic
from hexq.eval.perplexity import make_windows, perplexity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the RTN baseline, the references
from reference import capture_router_counts, load_model  # noqa: E402
from rtn import rtn_quantize_model  # noqa: E402

SEQLEN = 256
DATA = ["wikitext2", *TRAIN_CORPORA]
RTN_BITS = [8, 4, 3, 2]


def parameter_counts(model, adapter) -> tuple[int, int]:
    """(total, active per token): active counts top_k of the routed experts and every other weight once;
    with tied embeddings the shared matrix is counted once."""
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    num_experts = getattr(config, adapter.num_experts_attr)
    expert_params = sum(
        getattr(getattr(layer, adapter.moe), adapter.experts).gate_up_proj.numel()
        + getattr(getattr(layer, adapter.moe), adapter.experts).down_proj.numel()
        for layer in model.model.layers
    )
    active = total - expert_params + expert_params * config.num_experts_per_tok // num_experts
    return total, active


def expert_load(model, adapter, streams: dict[str, torch.Tensor], windows: int) -> dict:
    num_experts = getattr(model.config, adapter.num_experts_attr)
    with torch.no_grad(), capture_router_counts(model, adapter, num_experts) as stats:
        for ids in streams.values():
            for batch in make_windows(ids, SEQLEN, windows).split(8):
                model(input_ids=batch, use_cache=False)
    load = stats.load
    top_quarter = max(1, num_experts // 4)
    return {
        "tokens_per_domain": windows * SEQLEN,
        "per_layer": [
            {
                "layer": layer,
                "never_used": int((stats.counts[layer] == 0).sum()),
                "min_share": round(float(load[layer].min()), 4),
                "max_share": round(float(load[layer].max()), 4),
                "uniform_share": round(1 / num_experts, 4),
                "top25pct_experts_share": round(float(load[layer].topk(top_quarter).values.sum()), 4),
                "share": [round(float(x), 4) for x in load[layer]],
            }
            for layer in range(load.shape[0])
        ],
    }


def ppl_table(model, streams, windows: int | None) -> dict[str, dict]:
    out = {}
    for name, ids in streams.items():
        r = perplexity(model, ids, SEQLEN, windows, batch_size=8)
        out[name] = {"perplexity": round(r.perplexity, 3), "windows": r.windows, "tokens_scored": r.tokens_scored}
    return out


def render_card(card: dict) -> str:
    fp, rtn = card["perplexity"], card["rtn"]
    lines = [
        f"# {card['name']}",
        "",
        f"A small {card['model_type']} Mixture-of-Experts language model trained by hexq's "
        "`scripts/train_reference.py` as a reference for quantization experiments. Weights are stored in bf16; "
        "hexq computes in fp32 on their upcast.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {card['architecture']} |",
        f"| layers / hidden / heads (kv) | {card['layers']} / {card['hidden']} / {card['heads']} "
        f"({card['kv_heads']}) |",
        f"| experts | {card['experts']} routed, top-{card['top_k']}, "
        f"expert intermediate size {card['expert_intermediate']} |",
        f"| vocabulary | {card['vocab']} (byte-level BPE trained on the three training parts) |",
        f"| parameters | {card['params_total']:,} total, {card['params_active']:,} active per token |",
        f"| training | {card['tokens_seen']:,} tokens seen, {card['train_minutes']:.1f} min on "
        f"{card['train_threads']} CPU thread(s), seed {card['seed']}, "
        f"per-layer balance loss coefficient {card['balance_coef']} |",
        "",
        f"## Perplexity (window {SEQLEN}, non-overlapping, all windows)",
        "",
        "Held-out text: the last 10% of each corpus (never trained on). WikiText-2 (test split) is out of "
        "domain: use it for relative changes.",
        "",
        "| data | perplexity | windows | tokens scored |",
        "|---|---|---|---|",
        *[f"| {k} | {v['perplexity']:.3f} | {v['windows']} | {v['tokens_scored']:,} |" for k, v in fp.items()],
        "",
        f"## RTN weight quantization (first {card['rtn_windows']} windows of each text)",
        "",
        "Symmetric, one grid per output channel, attention and expert weights; router, embeddings, norms and "
        "LM head kept in full precision. Relative change against full precision on the same windows.",
        "",
        "| bits | " + " | ".join(DATA) + " |",
        "|---|" + "---|" * len(DATA),
    ]
    base = rtn["fp"]
    for bits in ["fp", *[str(b) for b in RTN_BITS]]:
        cells = []
        for name in DATA:
            value = rtn[bits][name]["perplexity"]
            change = "" if bits == "fp" else f" ({100 * (value / base[name]['perplexity'] - 1):+.1f}%)"
            cells.append(f"{value:.2f}{change}")
        lines.append(f"| {bits} | " + " | ".join(cells) + " |")
    load = card["expert_load"]
    lines += [
        "",
        f"## Expert load per layer (held-out text, {load['tokens_per_domain']:,} tokens per domain)",
        "",
        "Share of routed (token, slot) pairs per expert. Uniform routing would give every expert "
        f"{load['per_layer'][0]['uniform_share']:.4f} and the top 25% of experts 25% of the load.",
        "",
        "| layer | never used | min share | max share | top-25% experts' share |",
        "|---|---|---|---|---|",
        *[f"| {r['layer']} | {r['never_used']} | {r['min_share']:.4f} | {r['max_share']:.4f} | "
          f"{100 * r['top25pct_experts_share']:.1f}% |" for r in load["per_layer"]],
        "",
        "Reproduce: `python scripts/model_card.py " + card["folder"] + "` (numbers) and "
        "`hexq eval " + card["folder"] + "` (the perplexity table).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rtn-windows", type=int, default=200)
    parser.add_argument("--load-windows", type=int, default=100)
    args = parser.parse_args()
    started = time.time()
    model, tokenizer, adapter = load_model(args.folder)
    meta = json.loads((args.folder / "training_meta.json").read_text())
    config = model.config
    streams = {name: tokenize(tokenizer, eval_text(name)) for name in DATA}
    total, active = parameter_counts(model, adapter)
    card = {
        "name": args.folder.name, "folder": str(args.folder), "model_type": config.model_type,
        "architecture": config.architectures[0], "layers": config.num_hidden_layers, "hidden": config.hidden_size,
        "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
        "experts": getattr(config, adapter.num_experts_attr), "top_k": config.num_experts_per_tok,
        "expert_intermediate": model.model.layers[0].mlp.experts.down_proj.shape[2], "vocab": config.vocab_size,
        "params_total": total, "params_active": active, "tokens_seen": meta["tokens_seen"],
        "train_minutes": meta["train_seconds"] / 60, "train_threads": meta["threads"], "seed": meta["seed"],
        "balance_coef": meta["balance_coef"], "seqlen": SEQLEN, "rtn_windows": args.rtn_windows,
    }
    card["perplexity"] = ppl_table(model, streams, None)
    print(json.dumps(card["perplexity"]), flush=True)
    card["expert_load"] = expert_load(model, adapter, {k: streams[k] for k in TRAIN_CORPORA}, args.load_windows)
    original = {name: p.detach().clone() for name, p in model.state_dict().items()}
    card["rtn"] = {"fp": ppl_table(model, streams, args.rtn_windows)}
    for bits in RTN_BITS:
        model.load_state_dict(original)
        rtn_quantize_model(model, adapter, QuantSpec(bits=bits, group_size=None, symmetric=True))
        card["rtn"][str(bits)] = ppl_table(model, streams, args.rtn_windows)
        print(bits, json.dumps(card["rtn"][str(bits)]), flush=True)
    card["measure_seconds"] = round(time.time() - started, 1)
    write_json_atomic(args.folder / "card.json", card)
    write_bytes_atomic(args.folder / "README.md", render_card(card).encode())
    print(f"wrote {args.folder}/README.md and card.json in {card['measure_seconds']:.0f}s")


if __name__ == "__main__":
    main()
