"""Train hexq's reference MoE models (and their shared byte-level BPE tokenizer) from the shared corpora.

    python scripts/train_reference.py tokenizer
    python scripts/train_reference.py model mixtral --steps 3000
    python scripts/train_reference.py model qwen3moe --steps 3000

Data: the training parts (first 90%) of austen, pydocs and foldoc; every sequence is a random window of one
domain, domains drawn uniformly, from a seeded generator. WikiText-2 and the held-out tails are never read.

Routing balance: transformers' built-in auxiliary loss pools expert counts over all layers, which lets single
layers keep dead experts. Here the Switch-Transformer balance loss E * sum_e f_e P_e is computed per layer and
averaged over layers, so every layer is pushed towards using all of its experts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hexq.base.data import TRAIN_CORPORA, corpus_text

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
TOKENIZER_DIR = MODELS / "tokenizer"
CACHE = ROOT / ".cache"
VOCAB_SIZE = 8192
SEQLEN = 256

ARCHS = {
    # Coarse experts, like Mixtral-8x7B: 8 experts, top-2.
    "mixtral": dict(
        model_type="mixtral",
        name="hexq-tiny-mixtral",
        config=dict(
            hidden_size=192, intermediate_size=384, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=True, router_aux_loss_coef=0.0,
        ),
    ),
    # Fine-grained experts, like Qwen3-30B-A3B: 32 small experts, top-4.
    "qwen3moe": dict(
        model_type="qwen3_moe",
        name="hexq-tiny-qwen3moe",
        config=dict(
            hidden_size=192, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
            norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=True, router_aux_loss_coef=0.0,
        ),
    ),
}


def train_tokenizer() -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [corpus_text(name, "train") for name in TRAIN_CORPORA]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        (line for text in texts for line in text.splitlines(keepends=True)),
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=["<|endoftext|>"],
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tokenizer.model_max_length = 1024
    tokenizer.save_pretrained(TOKENIZER_DIR)
    print(f"tokenizer: vocab {len(tokenizer)} -> {TOKENIZER_DIR}")


def token_streams(tokenizer) -> dict[str, torch.Tensor]:
    """Training-part token ids per domain, cached on disk (the cache is keyed by the tokenizer file's size)."""
    CACHE.mkdir(exist_ok=True)
    key = (TOKENIZER_DIR / "tokenizer.json").stat().st_size
    streams = {}
    for name in TRAIN_CORPORA:
        path = CACHE / f"train-{name}-{key}.pt"
        if not path.exists():
            ids = tokenizer(corpus_text(name, "train"), add_special_tokens=False)["input_ids"]
            torch.save(torch.tensor(ids, dtype=torch.int32), path)
        streams[name] = torch.load(path).long()
    return streams


def sample_batch(streams: dict[str, torch.Tensor], batch: int, generator: torch.Generator) -> torch.Tensor:
    names = list(streams)
    rows = []
    for _ in range(batch):
        stream = streams[names[int(torch.randint(len(names), (1,), generator=generator))]]
        start = int(torch.randint(0, stream.numel() - SEQLEN - 1, (1,), generator=generator))
        rows.append(stream[start : start + SEQLEN])
    return torch.stack(rows)


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over layers of E * sum_e f_e * P_e (Switch Transformer), each layer balanced on its own."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)  # [T, E]
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        fraction = F.one_hot(chosen, num_experts).float().sum(dim=1).mean(dim=0) / top_k  # f_e
        losses.append(num_experts * (fraction * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(arch: str, steps: int, batch: int, lr: float, balance_coef: float, seed: int, threads: int,
                experts_impl: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    spec = ARCHS[arch]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = AutoConfig.for_model(spec["model_type"], vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **spec["config"])
    model = AutoModelForCausalLM.from_config(config, experts_implementation=experts_impl)
    model.train()
    streams = token_streams(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    out = MODELS / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "training_log.jsonl"
    log = log_path.open("w")
    top_k = config.num_experts_per_tok
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=100)
        ids = sample_batch(streams, batch, generator)
        output = model(input_ids=ids, output_router_logits=True)
        ce = F.cross_entropy(output.logits[:, :-1].reshape(-1, config.vocab_size).float(), ids[:, 1:].reshape(-1))
        balance = per_layer_balance_loss(output.router_logits, top_k)
        loss = ce + balance_coef * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.time() - start
            tokens = (step + 1) * batch * SEQLEN
            record = dict(step=step, tokens=tokens, seconds=round(elapsed, 1), loss=round(loss.item(), 4),
                          ce=round(ce.item(), 4), balance=round(balance.item(), 4),
                          tokens_per_s=round(tokens / elapsed, 1))
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
    elapsed = time.time() - start
    model.eval()
    model.config.output_router_logits = False
    # Stored in bf16, as released LLMs are, to keep each folder under 20 MB; hexq computes in fp32 from these.
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = dict(arch=arch, steps=steps, batch=batch, seqlen=SEQLEN, tokens_seen=steps * batch * SEQLEN,
                train_seconds=round(elapsed, 1), lr=lr, balance_coef=balance_coef, seed=seed, threads=threads,
                experts_implementation=experts_impl, torch=torch.__version__)
    (out / "training_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved {out} after {elapsed:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    model = sub.add_parser("model", help="train one reference model")
    model.add_argument("arch", choices=sorted(ARCHS))
    model.add_argument("--steps", type=int, default=3000)
    model.add_argument("--batch", type=int, default=16)
    model.add_argument("--lr", type=float, default=3e-3)
    model.add_argument("--balance-coef", type=float, default=0.01)
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--threads", type=int, default=1)
    model.add_argument("--experts-impl", default="eager")
    args = parser.parse_args()
    if args.what == "tokenizer":
        train_tokenizer()
    else:
        train_model(args.arch, args.steps, args.batch, args.lr, args.balance_coef, args.seed, args.threads,
                    args.experts_impl)


if __name__ == "__main__":
    main()
