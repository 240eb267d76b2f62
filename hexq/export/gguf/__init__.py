"""`hexq export --format gguf` (hexq.export.gguf.command.export_gguf): an artifact as one GGUF file for llama.cpp.

Modules: plan (each routed expert's source and each tensor's GGML type), arch (llama.cpp's metadata and tokenizer
per family), write (the tensor plan and the streamed writer), check (gguf-py's blocks, then llama.cpp's logits),
command (write, check, publish).
"""
