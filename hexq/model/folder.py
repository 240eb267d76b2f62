"""Loading a HuggingFace MoE checkpoint from a local folder, with the checks a user's mistake needs."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from hexq.base.errors import HexqError
from hexq.base.io import file_sha256
from hexq.model.adapters import ADAPTERS, MoEAdapter, adapter_for, supported_types

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells a repository


def resolve_model(name: str | Path, revision: str | None = None) -> Path:
    """The local folder of a model given as a folder, or as a hub id (owner/name) that is not a folder here: the
    snapshot in the local hub cache first, else downloaded (safetensors shards, config, tokenizer, generation
    config) where the network and HF_HUB_OFFLINE allow, as llm-compressor and auto-round resolve ids. Shards are
    still read one at a time from that folder. A one-line error when the id is in no cache and cannot be fetched."""
    folder = Path(name)
    if folder.exists() or not HUB_ID.match(str(name)):
        if revision is not None:
            raise HexqError(f"--revision {revision} applies to a hub id, and {name} is a local folder")
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]
    try:
        return Path(snapshot_download(str(name), revision=revision, local_files_only=True, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(str(name), revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise HexqError(f"{name} is neither a local folder nor in the hub cache ({hub_cache()}), and the hub cannot "
                        "be reached (HF_HUB_OFFLINE is set or the network is off)") from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise HexqError(f"{name}: not a local folder, and the hub did not give it: {str(error).splitlines()[0]}") \
            from None


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def read_model_config(folder: Path) -> dict:
    """config.json of a model folder; a one-line error for a missing folder, file or broken JSON."""
    if not folder.is_dir():
        raise HexqError(f"model folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise HexqError(f"{folder} is not a HuggingFace model folder (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HexqError(f"{path} is not valid JSON: {exc}") from None


def check_moe_folder(folder: Path) -> MoEAdapter:
    """The adapter for the model in `folder`, or a HexqError naming what is wrong."""
    config = read_model_config(folder)
    model_type = config.get("model_type")
    if model_type is None:
        raise HexqError(f"{folder}/config.json has no model_type")
    has_experts = any(config.get(key) for key in EXPERT_COUNT_KEYS)
    if model_type not in ADAPTERS and not has_experts:
        raise HexqError(f"{folder} holds a dense {model_type} model, not a Mixture-of-Experts model; "
                        f"hexq supports: {', '.join(supported_types())}")
    adapter = adapter_for(model_type)
    if not has_experts:
        keys = ", ".join(EXPERT_COUNT_KEYS)
        raise HexqError(f"{folder} is a {model_type} model without routed experts (none of {keys} is set)")
    return adapter


def context_length(config) -> int:
    """The longest sequence a model's config allows (0: the config does not say)."""
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def model_fingerprint(folder: Path) -> str:
    """SHA-256 over the names and SHA-256s of the model's weight shards and config (not its tokenizer or card);
    each file's hash comes from hexq's stat-keyed cache (hexq.base.io.file_sha256) when the file has not changed."""
    digest = hashlib.sha256()
    for path in sorted([*Path(folder).glob("*.safetensors"), Path(folder) / "config.json"]):
        digest.update(f"{path.name}:{file_sha256(path, cached=True)}\n".encode())
    return digest.hexdigest()


def source_state(folder: Path, fingerprint: str) -> str | None:
    """Whether the model folder a calibration or an artifact was made from is still what it was: None when it is,
    "gone" when the folder is missing, "changed" when its weights hash differs from `fingerprint`."""
    if not Path(folder).is_dir():
        return "gone"
    if model_fingerprint(folder) != fingerprint:
        return "changed"
    return None
