"""The layer-streaming reader: hub checkpoints of every family read one layer at a time give the model's own
logits, corrupt or mismatched checkpoints give one-line errors naming the file and tensor, activations spill to
disk past their limit, and perplexity equals the in-memory path on the reference models."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hexq.base.errors import HexqError
from hexq.base.hidden import HiddenStore
from hexq.eval.run import evaluate_model
from hexq.model.checkpoint import Checkpoint
from hexq.model.layer_pass import full_precision_plan
from hexq.model.streaming import open_model
from tests.conftest import REFERENCE_MODELS, TINY_CONFIGS, save_tiny_model

from reference import load_model, stream_logits

CPU = torch.device("cpu")
IDS = torch.randint(0, 8192, (3, 16), generator=torch.Generator().manual_seed(3))


def streamed_logits(folder, ids=IDS):
    streamed, _ = open_model(folder, CPU)
    return stream_logits(streamed, ids, full_precision_plan(streamed), batch_size=2)


def in_memory_logits(folder, ids=IDS):
    model, _, _ = load_model(folder)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_streams_to_the_model_s_own_logits(family, tmp_path):
    """save_pretrained writes the hub's per-expert keys (and Mixtral/PhiMoE's block_sparse_moe names); the reader
    maps them onto the fused layout itself, and the expert-by-expert computation equals the family's forward."""
    folder = save_tiny_model(tmp_path / family, family)
    keys = Checkpoint(folder).weight_map
    assert any(".experts.0." in key for key in keys)  # per-expert keys on disk, as the hub ships them
    got, want = streamed_logits(folder), in_memory_logits(folder)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_sharded_index_and_fused_layouts(tmp_path):
    folder = save_tiny_model(tmp_path / "one", "qwen3_moe")
    model, _, _ = load_model(folder)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(set(Checkpoint(sharded).weight_map.values())) > 1
    fused = tmp_path / "fused"  # a checkpoint that already holds transformers' in-memory layout
    fused.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / name).write_bytes((folder / name).read_bytes())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
             not model.config.tie_word_embeddings}
    save_file(state, fused / "model.safetensors")
    want = in_memory_logits(folder)
    for variant in (sharded, fused):
        assert (streamed_logits(variant) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("model") / "m", "mixtral")
    model, _, _ = load_model(folder)
    out = tmp_path_factory.mktemp("sharded") / "m"
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    return out


def copy_checkpoint(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def one_line_error(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message


def test_index_naming_a_missing_shard(sharded_model, tmp_path):
    broken = copy_checkpoint(sharded_model, tmp_path / "b")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (broken / shard).unlink()
    with pytest.raises(HexqError) as err:
        open_model(broken, CPU)
    one_line_error(err, shard, "not in")


def test_missing_and_misshaped_tensors_are_named(sharded_model, tmp_path):
    broken = copy_checkpoint(sharded_model, tmp_path / "b")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    key = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    shard = broken / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, shard)
    with pytest.raises(HexqError) as err:
        streamed_logits(broken)
    one_line_error(err, key, "shape", shard.name)
    del tensors[key]
    save_file(tensors, shard)
    with pytest.raises(HexqError) as err:
        streamed_logits(broken)
    one_line_error(err, key, "missing")


def test_unknown_dtype_and_corrupt_shard_are_named(sharded_model, tmp_path):
    broken = copy_checkpoint(sharded_model, tmp_path / "b")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    key = "model.layers.0.self_attn.q_proj.weight"
    shard = broken / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key].to(torch.int8)
    save_file(tensors, shard)
    with pytest.raises(HexqError) as err:
        streamed_logits(broken)
    one_line_error(err, key, "dtype torch.int8")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(HexqError) as err:
        streamed_logits(broken)
    one_line_error(err, shard.name, "unreadable")


def test_activations_spill_past_their_limit_and_are_removed(tmp_path):
    store = HiddenStore(limit_bytes=3 * 4 * 100, spill_dir=tmp_path)
    tensors = [torch.full((100,), float(i)) for i in range(6)]
    for tensor in tensors:
        store.append(tensor)
    assert store.spilled == 3 and store.memory_bytes == 1200
    store[4] = tensors[4] + 1
    assert [float(t[0]) for t in store] == [0, 1, 2, 3, 5, 5]
    assert any(tmp_path.iterdir())
    store.close()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_streamed_perplexity_equals_the_in_memory_path(name):
    """hexq eval streams every window through layer l before l+1; the number is today's in-memory one."""
    from hexq.base.data import eval_text, tokenize
    from hexq.eval.perplexity import perplexity

    folder = REFERENCE_MODELS[name]
    model, tokenizer, _ = load_model(folder)
    want = perplexity(model, tokenize(tokenizer, eval_text("austen")), 128, 6, 4).perplexity
    (row,) = evaluate_model(folder, ["austen"], 128, 6, 4, "cpu", activation_limit=100_000)  # spills too
    assert math.isclose(row.result.perplexity, want, rel_tol=1e-5)


def test_experts_assembled_from_per_expert_tensors_hold_one_copy(tmp_path):
    """A hub checkpoint stores each expert's projections as tensors of their own, assembled into one [E, ...] tensor
    per projection: the shards' pages read for it are released every MAPPED_BYTES, so the peak RSS grows by the
    copy, not by the copy and every page it was read from (twice the layer's experts before; measured with each of
    the two)."""
    import subprocess
    import sys

    experts, inner, hidden = 24, 512, 1024
    tensors = {}
    for e in range(experts):
        for name, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)),
                            ("down_proj", (hidden, inner))):
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = torch.full(shape, e + 1.0, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    expert_bytes = experts * 3 * inner * hidden * 2  # 72 MiB
    code = f"""
from hexq.model import checkpoint
checkpoint.MAPPED_BYTES = 4 << 20
source = checkpoint.Checkpoint({str(tmp_path)!r})
from hexq.base.devices import peak_rss_bytes
with open("/proc/self/clear_refs", "w") as handle:  # resets the peak (VmHWM) to the current RSS
    handle.write("5")
before = peak_rss_bytes()
gate_up, down = source.read_fused_experts("model.layers.0.mlp.experts", {experts}, ({2 * inner}, {hidden}),
                                          ({hidden}, {inner}))
assert float(gate_up[5, -1, 0]) == 6.0 and float(down[{experts - 1}, 0, 0]) == {experts}.0
print("GROWTH", peak_rss_bytes() - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth = int(done.stdout.split("GROWTH")[-1])
    assert growth < 1.3 * expert_bytes, f"{growth / 2**20:.0f} MiB for {expert_bytes / 2**20:.0f} MiB of experts"


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_a_share_of_the_experts_reads_only_their_bytes(layout, tmp_path):
    """One rank's experts (read_fused_experts with rows): the same values as those rows of a full read, and the peak
    RSS grows by their bytes, not by the layer's (what lets each rank of a distributed calibration hold its share)."""
    import subprocess
    import sys

    experts, inner, hidden, rows = 24, 1024, 1024, (8, 12)
    prefix = "model.layers.0.mlp.experts"
    if layout == "hub":
        tensors = {f"{prefix}.{e}.{name}.weight": torch.full(shape, e + 1.0, dtype=torch.bfloat16)
                   for e in range(experts) for name, shape in (("gate_proj", (inner, hidden)),
                                                               ("up_proj", (inner, hidden)),
                                                               ("down_proj", (hidden, inner)))}
    else:
        values = torch.arange(1, experts + 1, dtype=torch.bfloat16)[:, None, None]
        tensors = {f"{prefix}.gate_up_proj": values.expand(experts, 2 * inner, hidden).contiguous(),
                   f"{prefix}.down_proj": values.expand(experts, hidden, inner).contiguous()}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    share_bytes = (rows[1] - rows[0]) * 3 * inner * hidden * 2  # 24 MiB of the layer's 144
    layer_bytes = experts * 3 * inner * hidden * 2
    code = f"""
from hexq.model import checkpoint
checkpoint.MAPPED_BYTES = 4 << 20
source = checkpoint.Checkpoint({str(tmp_path)!r})
from hexq.base.devices import peak_rss_bytes
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before = peak_rss_bytes()
gate_up, down = source.read_fused_experts({prefix!r}, {experts}, ({2 * inner}, {hidden}), ({hidden}, {inner}),
                                          range(*{rows}))
growth = peak_rss_bytes() - before
assert gate_up.shape[0] == down.shape[0] == {rows[1] - rows[0]}
assert [float(gate_up[j, -1, 0]) for j in range(gate_up.shape[0])] == [float(e + 1) for e in range(*{rows})]
assert [float(down[j, 0, -1]) for j in range(down.shape[0])] == [float(e + 1) for e in range(*{rows})]
print("GROWTH", growth)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth = int(done.stdout.split("GROWTH")[-1])
    # a fixed ~10 MiB of first-read overhead, far below the 120 MiB of the other experts
    assert growth < share_bytes + (layer_bytes - share_bytes) / 4, f"{growth / 2**20:.0f} MiB for a share of " \
        f"{share_bytes / 2**20:.0f} MiB of {layer_bytes / 2**20:.0f} MiB"


def test_a_layer_with_a_share_of_its_experts_refuses_the_others(tiny_qwen3moe):
    from hexq.base.errors import HexqError
    from hexq.model.streaming import open_model

    streamed, _tokenizer = open_model(tiny_qwen3moe, torch.device("cpu"))
    with streamed.layer(0) as loaded:
        full_gate_up, full_down = loaded.gate_up.clone(), loaded.down.clone()
    with streamed.layer(0) as loaded:
        loaded.read_experts(range(2, 5))
        gate_up, down = loaded.experts_of([4, 2])
        assert torch.equal(gate_up, full_gate_up[[4, 2]]) and torch.equal(down, full_down[[4, 2]])
        with pytest.raises(HexqError, match="expert 5 was not read"):
            loaded.experts_of([3, 5])
        with pytest.raises(HexqError, match="only experts 2..4 were read"):
            loaded.gate_up  # noqa: B018
