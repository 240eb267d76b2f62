"""Decode and prefill speed of `hexq run` against llama.cpp on the same real-shaped checkpoint, measured in one run.

    python benchmarks/engines.py --checkpoint CKPT --llama-cpp DIR
    python benchmarks/engines.py --checkpoint CKPT --llama-cpp DIR --cgroup --repeats 3

CKPT: a checkpoint from scripts/make_checkpoint.py (e.g. `--family qwen3_moe --size published --layers 6 --vocab
8192`). DIR: llama.cpp's source tree (the one llama-cpp-python vendors: convert_hf_to_gguf.py, gguf-py) with its
tools built in DIR/build/bin (llama-quantize, llama-bench: `bash scripts/llama_cpp.sh --bench` builds them in
.cache/llama.cpp/0.3.36/llama_cpp_python-0.3.36/vendor/llama.cpp).

What runs (every row a fresh process, --threads threads, nothing else running; the median over --repeats processes):
  hexq, native decode     `hexq run` on the 3- and 4-bit artifacts, every expert resident in the packed cache: a
                          128-token held-out austen prompt prefilled by the transformers path, then --decode greedy
                          tokens by the native step (hexq.runtime.native); tokens/s = 1 / median decode step,
                          prefill tokens/s = prompt tokens / time to the first token
  hexq, transformers decode
                          the same with `--decode transformers`: each token through the transformers model with the
                          kernels called per matrix (the path the native step replaces)
  llama.cpp               its own GGUFs of the checkpoint (convert_hf_to_gguf.py to bf16, then llama-quantize Q4_0
                          and Q3_K_S) and hexq's GGUF export of the 4-bit artifact (experts Q4_1 holding its codes,
                          attention Q8_0), timed by llama-bench: decode tg --decode at depth 128 (the KV cache holding
                          a prompt's worth of positions, as for hexq), prefill pp128
  long context            hexq 3-bit (native decode) and llama.cpp Q4_0 once more with a --depth-token held-out
                          prompt (2048 by default) prefilled: decode only (llama-bench tg at depth --depth)
Artifacts: the checkpoint calibrated as the bundled experts-mixed stores it (W8A8 attention, the head at 8 bits per
channel) but by round-to-nearest (decode speed does not depend on how the codes were chosen) on 16 windows, packed
at 3.0 and 4.0 bits (the 4-bit one with `--bank export`: the 4-bit replica of every 8-bit expert, which the GGUF
export writes for it) and at 2.5 bits (2, 3, 4 and 8-bit experts mixed in every layer by the allocation; native
decode row only); and once more with the dense linears at 4 bits in groups of 32 with full-precision activations
(W4A16, attention at Q4_0's width; Q4_0 keeps its head at Q6_K; DENSE4_RECIPE), packed at 3.0 bits (native decode
row only).

Bytes per decoded token (from the files, not timed): what one decode step reads - every dense tensor a token uses
(attention, norms, routers, the head row-block it multiplies: the whole head; the embedding row aside) plus top_k of
the num_experts experts per layer at their stored size (hexq: the allocation's mean slot bytes; llama.cpp: the
expert tensors' bytes / num_experts * top_k). Memory read bandwidth: torch.sum over a 2 GiB float32 tensor on
--threads threads (median of 5), in a process of its own right after each warm engine process; the share of it an
engine uses = bytes per token * tokens/s / the median bandwidth measured next to that engine's processes (the
machine's bandwidth drifts by up to 2x within minutes: one figure for the run would compare an engine with another
minute's machine).

With --cgroup, once more cold (page cache dropped) inside a memory cgroup of --cgroup-fraction (default half) of
llama.cpp's Q4_0 file, page cache counted, as on a machine with less memory than the model (benchmarks/runtime.py
has the mechanism), --cgroup-repeats processes each: hexq 3-bit with --memory the limit less OVERHEAD (the
interpreter and libraries, which --memory does not count yet), packed cache: not every expert fits, so the native
step loads its misses through the cache and reads ahead; llama.cpp's Q4_0 and Q3_K_S reading their files through
mmap (`--repack 0 -lm mmap`: with its default repacking llama.cpp copies the weights into memory of its own, and at
this limit the OOM killer ends it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from runtime import MemoryCgroup, cgroup_root, child_env, drop_page_cache, files_under, read_bandwidth, vm_hwm

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 128
# What a `hexq run` process holds beyond --memory: interpreter, torch, transformers and the model skeleton (measured:
# peak RSS 951 MiB at --memory 567 MiB, AMD EPYC) plus room for the page cache its reads go through.
OVERHEAD = 450 * 2**20
# The long-context pair's prompt: the KV cache then holds 16x the main rows' positions and attention is a large part
# of a step (hexq's float32 cache: 24 KB per position of the 6-layer checkpoint, 50 MB at 2048 positions)
LONG_CONTEXT = 2048
MMAP = ["--repack", "0", "-lm", "mmap"]  # llama.cpp reading its weights through mmap, as under a memory limit
DENSE4 = "hexq 3-bit, dense W4A16 g32, head 8-bit"
MIXED = "hexq mixed 2.5-bit"  # the allocation's 2, 3, 4 and 8-bit experts side by side in every layer
NATIVE_ONLY = (DENSE4, MIXED)  # rows measured on the native step alone
CGROUP_HEXQ = "hexq 3-bit --memory, packed cache"
RTN_RECIPE = """name: experts-rtn
version: 2
smoothing: {method: none}
weights: {bits: 8, group_size: null, symmetric: false, method: rtn}
activations: {bits: 8, dynamic: true, symmetric: false}
experts:
  mode: replicas
  replica_bits: [2, 3, 4, 8]
  propagate_bits: 4
  weights: {group_size: 32, symmetric: false, method: rtn}
  activations: {bits: null}
head: {bits: 8, method: rtn}
calibration: {num_samples: 16, seqlen: 256, seed: 0}
pack: {widths: [2, 3, 4, 8]}
"""
# The same experts at 3 bits with the dense linears (attention) at 4 bits in groups of 32 and activations in full
# precision, the width llama.cpp's Q4_0 gives attention, and the head at 8 bits per channel (Q4_0's is Q6_K, 6.6
# bits): what a decode step reads then differs from Q4_0's mainly by the experts' 3 bits against 4.5. Speed only: 4
# windows are enough.
DENSE4_RECIPE = """name: experts-rtn-dense4-head8
version: 2
smoothing: {method: none}
weights: {bits: 4, group_size: 32, symmetric: false, method: rtn}
activations: {bits: null}
experts:
  mode: replicas
  replica_bits: [3]
  propagate_bits: 3
  weights: {group_size: 32, symmetric: false, method: rtn}
  activations: {bits: null}
head: {bits: 8}
calibration: {num_samples: 4, seqlen: 256, seed: 0}
pack: {widths: [3]}
"""


# ------------------------------------------------------------------------------------------ children


def prompt_ids(artifact: Path, tokens: int = PROMPT_TOKENS) -> list[int]:
    from hexq.artifact.reader import Artifact
    from hexq.base.data import eval_text, tokenize
    from hexq.runtime.model import artifact_tokenizer

    ids = tokenize(artifact_tokenizer(Artifact(artifact)), eval_text("austen"))
    return ids[-tokens:].tolist()  # held-out text the perplexity windows do not use


def child_hexq(spec: dict) -> dict:
    import torch

    from hexq.runtime.engine import Runtime

    torch.set_num_threads(spec["threads"])
    artifact = Path(spec["artifact"])
    if spec["cold"]:
        drop_page_cache(files_under(artifact))
    runtime = Runtime(artifact, memory_bytes=spec.get("memory"), cache=spec["cache"], threads=spec["threads"],
                      decode=spec["path"])
    if spec.get("memory") is None:
        runtime.fill_all()
    _, stats = runtime.generate(runtime.tokenizer.decode(spec["prompt"]), spec["decode"])
    runtime.close()
    return {"tpot_ms": 1000 * stats.tpot_seconds, "peak_rss_mib": vm_hwm() / 2**20,
            "prefill_tps": len(spec["prompt"]) / stats.ttft_seconds, "decode_path": stats.decode_path,
            "native_profile": stats.native_profile,
            "kernel": stats.kernel_path, "cache": stats.cache_format, "dense_mib": stats.plan.dense_bytes / 2**20,
            "experts_mib": stats.plan.fast_tier_bytes / 2**20}


def child_llama(spec: dict) -> dict:
    """llama.cpp's own benchmark tool on one GGUF: decode (tg at depth `depth`, PROMPT_TOKENS unless given: the KV
    cache holds a prompt's worth of positions, as in the hexq rows) and prefill (pp of PROMPT_TOKENS; not for a
    `depth` row), one repetition each (the process is repeated by `repeated`); peak RSS of the tool's processes."""
    import resource

    if spec["cold"]:
        drop_page_cache([Path(spec["gguf"])])
    bench = [str(Path(spec["llama_bin"]) / "llama-bench"), "-m", spec["gguf"], "-t", str(spec["threads"]), "-r",
             "1", "-o", "json", *spec.get("args", [])]
    depth = spec.get("depth", PROMPT_TOKENS)
    decode = json.loads(subprocess.run([*bench, "-p", "0", "-n", str(spec["decode"]), "-d", str(depth)],
                                       capture_output=True, text=True, check=True).stdout)
    row = {"tpot_ms": 1000 / decode[0]["avg_ts"]}
    if "depth" not in spec:
        prefill = json.loads(subprocess.run([*bench, "-p", str(PROMPT_TOKENS), "-n", "0"], capture_output=True,
                                            text=True, check=True).stdout)
        row["prefill_tps"] = prefill[0]["avg_ts"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return row | {"peak_rss_mib": peak / 2**20}


def child_bandwidth(spec: dict) -> dict:
    return {"read_gbps": read_bandwidth(spec["threads"])}


CHILDREN = {"hexq": child_hexq, "llama": child_llama, "bandwidth": child_bandwidth}


def run_child(spec: dict, cgroup: MemoryCgroup | None = None) -> dict:
    env = child_env(serves_hexq=spec["kind"] == "hexq") | {"OMP_NUM_THREADS": str(spec.get("threads", 1))}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=ROOT, preexec_fn=cgroup.enter if cgroup else None)
    measured = cgroup.report() if cgroup else {}
    if done.returncode != 0:
        if measured.get("cgroup_oom_kills"):
            return {"error": "killed by the OOM killer at the cgroup's limit", **measured}
        return {"error": " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:]), **measured}
    return json.loads(done.stdout.strip().splitlines()[-1]) | measured


def repeated(spec: dict, repeats: int, cgroup_limit: int | None = None, root: Path | None = None) -> dict:
    """The median row of `repeats` fresh processes (by tokens/s), with the read bandwidth measured after each warm
    one (`read_gbps`: their median); errors are returned as they are."""
    rows, bandwidth = [], []
    for _ in range(repeats):
        cgroup = MemoryCgroup(root, cgroup_limit) if cgroup_limit else None
        try:
            row = run_child(spec, cgroup)
        finally:
            if cgroup:
                cgroup.remove()
        if "error" in row:
            return row
        rows.append(row | {"tokens_per_s": 1000 / row["tpot_ms"]})
        if not cgroup_limit:  # a cold run reads from disk, not at the memory's bandwidth
            bandwidth.append(run_child({"kind": "bandwidth", "threads": spec["threads"]})["read_gbps"])
    rows.sort(key=lambda r: r["tokens_per_s"])
    measured = {"read_gbps": statistics.median(bandwidth), "read_gbps_all": bandwidth} if bandwidth else {}
    return rows[len(rows) // 2] | {"tokens_per_s_all": [round(r["tokens_per_s"], 2) for r in rows]} | measured


# ------------------------------------------------------------------------------------------ preparing


def older(made: Path, source: Path) -> bool:
    """Whether `made` is missing or older than `source` (then it is made again from it)."""
    return not made.exists() or made.stat().st_mtime_ns < source.stat().st_mtime_ns


def calibrated(checkpoint: Path, work: Path, name: str, text: str) -> tuple[Path, Path]:
    """(recipe file, calibration folder) of `checkpoint` calibrated with recipe `text`: hexq calibrate leaves a
    folder holding this very calibration as it is and replaces one made from another recipe or checkpoint."""
    recipe = work / f"{name}.yaml"
    recipe.write_text(text)
    calibration = work / ("calibration" if name == "experts-rtn" else f"calibration-{name}")
    subprocess.run([sys.executable, "-m", "hexq_cli.main", "calibrate", str(checkpoint), "-r", str(recipe), "-o",
                    str(calibration), "--force"], check=True, cwd=ROOT)
    return recipe, calibration


def packed(calibration: Path, recipe: Path, out: Path, bits: float, *extra: str) -> Path:
    if older(out / "manifest.json", calibration / "manifest.json"):
        subprocess.run([sys.executable, "-m", "hexq_cli.main", "pack", str(calibration), "-r", str(recipe), "--bits",
                        str(bits), "-o", str(out), "--force", *extra], check=True, cwd=ROOT)
    return out


def hexq_artifacts(checkpoint: Path, work: Path) -> dict[str, Path]:
    recipe, calibration = calibrated(checkpoint, work, "experts-rtn", RTN_RECIPE)
    artifacts = {}
    for bits in (3, 4):
        bank = ["--bank", "export"] if bits == 4 else []  # what the GGUF export of the 4-bit artifact needs
        artifacts[f"hexq {bits}-bit"] = packed(calibration, recipe, work / f"hexq-{bits}.hexq", bits, *bank)
    artifacts[MIXED] = packed(calibration, recipe, work / "hexq-2.5.hexq", 2.5)
    recipe, calibration = calibrated(checkpoint, work, "experts-rtn-dense4-head8", DENSE4_RECIPE)
    artifacts[DENSE4] = packed(calibration, recipe, work / "hexq-3-dense4-head8.hexq", 3)
    return artifacts


def llama_ggufs(checkpoint: Path, llama: Path, work: Path) -> dict[str, Path]:
    """llama.cpp's own conversion (bf16) and quantizations of the checkpoint."""
    bf16 = work / "model-bf16.gguf"
    if not bf16.exists():
        # The converter identifies a tokenizer's pre-tokenizer by a hash table that does not know hexq's tokenizer
        # (a byte-level BPE with GPT-2's pre-tokenizer): told so, it converts the rest as it would.
        code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = ['convert_hf_to_gguf.py', *sys.argv[2:]]; "
                "import convert_hf_to_gguf as c; from conversion.base import TextModel; "
                "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; c.main()")
        env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
        with published(bf16) as partial:
            subprocess.run([sys.executable, "-c", code, str(llama), str(checkpoint), "--outtype", "bf16",
                            "--outfile", str(partial)], check=True, env=env)
    out = {"llama.cpp bf16": bf16}
    for kind in ("Q4_0", "Q3_K_S"):
        path = work / f"model-{kind}.gguf"
        if not path.exists():
            with published(path) as partial:
                subprocess.run([str(llama / "build" / "bin" / "llama-quantize"), str(bf16), str(partial), kind],
                               check=True)
        out[f"llama.cpp {kind}"] = path
    return out


@contextlib.contextmanager
def published(path: Path):
    """A temporary name next to `path`, renamed to it once the block ends without error (else removed): a
    conversion that dies half-way (a full disk, a killed run) leaves no file that a later run would take as made."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def hexq_gguf(artifact: Path, work: Path) -> Path:
    """hexq's GGUF export of an artifact (`hexq export --format gguf`), written again when older than the artifact."""
    out = work / f"{artifact.stem}.gguf"
    if older(out, artifact / "manifest.json"):
        subprocess.run([sys.executable, "-m", "hexq_cli.main", "export", str(artifact), "--format", "gguf", "-o",
                        str(out), "--no-check", "--force"], check=True, cwd=ROOT)
    return out


def bytes_per_token_hexq(artifact: Path) -> dict:
    """Bytes one decode step reads: the dense part as served (quantized linears packed, the rest bf16, the embedding
    table aside: one row) plus top_k experts per layer at the allocation's mean slot bytes; less, for each packed
    matrix, what the kernels' layout on this CPU leaves unread (CpuKernels.read_nbytes: rows8z4's zeros)."""
    import torch

    from hexq.artifact.reader import Artifact
    from hexq.packed.cpu import load_cpu_kernels
    from hexq.packed.weight import PROJECTIONS
    from hexq.runtime.model import dense_plan_bytes, skeleton
    from hexq.runtime.source import SlotSizes

    opened = Artifact(artifact)
    streamed = skeleton(opened, torch.device("cpu"), torch.bfloat16)
    kernels = load_cpu_kernels()
    dense = dense_plan_bytes(streamed, opened)
    for name in opened.quantized_linears:
        if kernels is not None and opened.has_param(name):
            weight = opened.packed_param(name, tuple(streamed.model.get_parameter(name).shape))
            dense -= weight.nbytes - kernels.read_nbytes(weight)
    embed = streamed.model.model.embed_tokens.weight.numel() * 2
    tied = getattr(streamed.config, "tie_word_embeddings", False)
    sizes = SlotSizes.of(opened, "packed")
    slots = []
    for row, widths in enumerate(opened.allocation):
        for expert, bits in enumerate(widths):
            if bits:
                slots.append(sizes.slot_bytes[bits] - sum(unread_zero_bytes(opened, kernels, row, expert, bits, p)
                                                          for p in PROJECTIONS))
    top_k = opened.top_k
    experts = statistics.mean(slots) * top_k * len(opened.moe_layers)
    return {"dense": dense - (0 if tied else embed), "experts": experts, "total": dense - (0 if tied else embed)
            + experts}


def unread_zero_bytes(opened, kernels, row: int, expert: int, bits: int, projection: str) -> int:
    """Bytes of one stored expert matrix the kernels on this CPU do not read (CpuKernels.read_nbytes), from its zeros
    alone (the codes are not read: they are read whole whatever the layout)."""
    import torch

    from hexq.artifact.format import expert_shard, replica_key
    from hexq.packed.weight import PackedWeight

    if kernels is None:
        return 0
    zero = opened.tensor(expert_shard(opened.moe_layers[row]), f"{replica_key(expert, bits, projection)}.zero")
    weight = PackedWeight(torch.empty(0, dtype=torch.uint8), zero, zero, bits, opened.expert_shape(projection))
    return weight.nbytes - kernels.read_nbytes(weight)


def bytes_per_token_gguf(path: Path, top_k: int, num_experts: int) -> dict:
    from gguf import GGUFReader

    dense = experts = 0
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name == "token_embd.weight":
            continue
        if "_exps." in tensor.name:
            experts += int(tensor.n_bytes) * top_k / num_experts
        else:
            dense += int(tensor.n_bytes)
    return {"dense": dense, "experts": experts, "total": dense + experts}


# ------------------------------------------------------------------------------------------ the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree with build/bin/llama-quantize")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cgroup", action="store_true")
    parser.add_argument("--cgroup-fraction", type=float, default=0.5, help="of llama.cpp's Q4_0 file")
    parser.add_argument("--cgroup-repeats", type=int, default=1)
    parser.add_argument("--depth", type=int, default=LONG_CONTEXT,
                        help="the long-context pair's prompt tokens (hexq 3-bit and llama.cpp Q4_0; 0: none)")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "engines.json")
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(CHILDREN[spec["kind"]](spec)))
        return 0
    if args.checkpoint is None or args.llama_cpp is None:
        parser.error("--checkpoint and --llama-cpp are required")
    run = start_run(args)
    args.work.mkdir(parents=True, exist_ok=True)
    artifacts = hexq_artifacts(args.checkpoint, args.work)
    ggufs = llama_ggufs(args.checkpoint, args.llama_cpp, args.work)
    llama_bin = args.llama_cpp / "build" / "bin"
    ggufs["llama.cpp on hexq's GGUF export (4-bit)"] = hexq_gguf(artifacts["hexq 4-bit"], args.work)
    config = json.loads((args.checkpoint / "config.json").read_text())
    top_k, experts = config["num_experts_per_tok"], config.get("num_experts", config.get("num_local_experts"))
    prompt = prompt_ids(next(iter(artifacts.values())))
    base = {"prompt": prompt, "decode": args.decode, "threads": args.threads, "cold": False}
    results: dict = {"benchmark": "engines", "checkpoint": str(args.checkpoint), "threads": args.threads,
                     "decode": args.decode, "prompt_tokens": PROMPT_TOKENS, "rows": []}
    for name, artifact in artifacts.items():
        traffic = bytes_per_token_hexq(artifact)
        for path in ("native",) if name in NATIVE_ONLY else ("native", "transformers"):
            row = repeated(base | {"kind": "hexq", "artifact": str(artifact), "cache": "packed", "path": path},
                           args.repeats)
            row |= {"engine": f"{name}, {path} decode", "bytes_per_token_mb": traffic["total"] / 1e6}
            results["rows"].append(row)
            write_results(args.out, results, run)
    for name, gguf in ggufs.items():
        traffic = bytes_per_token_gguf(gguf, top_k, experts)
        row = repeated(base | {"kind": "llama", "gguf": str(gguf), "llama_bin": str(llama_bin)}, args.repeats)
        results["rows"].append(row | {"engine": name, "bytes_per_token_mb": traffic["total"] / 1e6,
                                      "file_mib": gguf.stat().st_size / 2**20})
        write_results(args.out, results, run)
    if args.depth:  # the same two engines with a long prompt's keys and values in the cache
        results["depth"] = args.depth
        long_prompt = prompt_ids(artifacts["hexq 3-bit"], args.depth)
        pair = {f"hexq 3-bit, native decode, depth {args.depth}": {
                    "kind": "hexq", "artifact": str(artifacts["hexq 3-bit"]), "cache": "packed", "path": "native",
                    "prompt": long_prompt},
                f"llama.cpp Q4_0, depth {args.depth}": {
                    "kind": "llama", "gguf": str(ggufs["llama.cpp Q4_0"]), "llama_bin": str(llama_bin),
                    "depth": args.depth}}
        for name, spec in pair.items():
            results["rows"].append(repeated(base | spec, args.repeats) | {"engine": name})
            write_results(args.out, results, run)
    if args.cgroup:
        root = cgroup_root()
        limit = int(ggufs["llama.cpp Q4_0"].stat().st_size * args.cgroup_fraction)
        hexq_row = {"kind": "hexq", "artifact": str(artifacts["hexq 3-bit"]), "cache": "packed",
                    "memory": limit - OVERHEAD, "path": "auto"}
        rows = {CGROUP_HEXQ: hexq_row} | {f"{name}, mmap": {"kind": "llama", "gguf": str(ggufs[name]), "args": MMAP,
                                                            "llama_bin": str(llama_bin)}
                                          for name in ("llama.cpp Q4_0", "llama.cpp Q3_K_S")}
        for name, spec in rows.items():
            row = repeated(base | spec | {"cold": True}, args.cgroup_repeats, limit, root) if root else {
                "error": "no writable memory cgroup"}
            results["rows"].append(row | {"engine": name, "cgroup_limit_mib": limit / 2**20})
            write_results(args.out, results, run)
    samples = [gbps for row in results["rows"] for gbps in row.get("read_gbps_all", [])]
    results["bandwidth_gbps"] = statistics.median(samples) if samples else None
    results["ratios"] = ratios(results)
    write_results(args.out, results, run, complete=True)
    print(render(results))
    return 0


def share(row: dict, results: dict) -> float:
    """The share of the read bandwidth an engine's row uses: against the bandwidth measured next to its own processes
    (results before that was measured: the run's one figure)."""
    gbps = row.get("read_gbps", results["bandwidth_gbps"])
    return row["bytes_per_token_mb"] * 1e6 * row["tokens_per_s"] / (gbps * 1e9)


def ratios(results: dict) -> dict:
    rows = {r["engine"]: r for r in results["rows"] if "error" not in r}
    out = {}
    q4, exported = rows.get("llama.cpp Q4_0"), rows.get("llama.cpp on hexq's GGUF export (4-bit)")
    if exported and q4:
        out["llama.cpp on hexq's GGUF export (4-bit) / llama.cpp Q4_0 tokens/s"] = (exported["tokens_per_s"]
                                                                                   / q4["tokens_per_s"])
    for name in ("hexq 3-bit, native decode", "hexq 4-bit, native decode", f"{MIXED}, native decode",
                 f"{DENSE4}, native decode"):
        ours, old = rows.get(name), rows.get(name.replace("native", "transformers"))
        if ours and q4:
            out[f"{name} / llama.cpp Q4_0 tokens/s"] = ours["tokens_per_s"] / q4["tokens_per_s"]
            out[f"{name} / llama.cpp Q4_0 prefill tokens/s"] = ours["prefill_tps"] / q4["prefill_tps"]
        if ours and old:
            out[f"{name} / the transformers decode path, tokens/s"] = ours["tokens_per_s"] / old["tokens_per_s"]
        if ours:
            out[f"{name}: share of the read bandwidth"] = share(ours, results)
    if q4:
        out["llama.cpp Q4_0: share of the read bandwidth"] = share(q4, results)
    depth = results.get("depth")
    ours, theirs = rows.get(f"hexq 3-bit, native decode, depth {depth}"), rows.get(f"llama.cpp Q4_0, depth {depth}")
    if ours and theirs:
        out[f"depth {depth}: hexq 3-bit, native decode / llama.cpp Q4_0 tokens/s"] = (ours["tokens_per_s"]
                                                                                    / theirs["tokens_per_s"])
    for name in ("llama.cpp Q4_0, mmap", "llama.cpp Q3_K_S, mmap"):
        if rows.get(CGROUP_HEXQ) and rows.get(name):
            out[f"cgroup: {CGROUP_HEXQ} / {name} tokens/s"] = (rows[CGROUP_HEXQ]["tokens_per_s"]
                                                              / rows[name]["tokens_per_s"])
    return out


def render(results: dict) -> str:
    lines = [f"Decode, {results['threads']} threads, {results['prompt_tokens']}-token prompt, {results['decode']} "
             f"tokens (median of the processes' median steps); read bandwidth "
             + ("not measured" if results["bandwidth_gbps"] is None else f"{results['bandwidth_gbps']:.1f} GB/s")
             + (" (median over the run; each share against the bandwidth measured next to its engine's processes)"
                if any("read_gbps" in row for row in results["rows"]) else ""),
             "| engine | decode tokens/s | prefill tokens/s | bytes/token (MB) | peak RSS (MiB) |",
             "|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | error: {row['error'][:120]} | | | |")
            continue
        mb = row.get("bytes_per_token_mb")
        prefill = row.get("prefill_tps")
        lines.append(f"| {row['engine']} | {row['tokens_per_s']:.2f} | {'' if prefill is None else f'{prefill:.0f}'} "
                     f"| {'' if mb is None else f'{mb:.0f}'} | {row['peak_rss_mib']:.0f} |")
    lines += [f"- {key}: {value:.3f}" for key, value in results.get("ratios", {}).items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
