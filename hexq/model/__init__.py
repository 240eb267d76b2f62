"""A HuggingFace MoE checkpoint read as hexq reads it: its folder checked, its family's adapter, its shards one
layer at a time, every window through one layer, and a layer's routed experts computed as quantized."""
