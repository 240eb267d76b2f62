"""Packed, versioned, verifiable artifacts: bit packing, safetensors shards, manifest."""
