"""Pure tensor functions: quantizers, GPTQ, smoothing, allocation. No module walking, no I/O."""
