"""`hexq export` (hexq.export.command.export_artifact): an artifact written as a compressed-tensors checkpoint, one
decoder layer at a time, with every part in the scheme calibration gave it wherever compressed-tensors can express
it, then checked against the model `hexq run` serves.

What each part becomes (hexq.export.codec explains the exact code mapping):
- attention, shared experts and dense layers' MLPs: the artifact's own grid (bits, groups or channels, symmetric or
  asymmetric with integer zero points) and activation setting (dynamic per-token, or none): bit-identical
  dequantized weights. Static activation ranges are refused (compressed-tensors would need per-tensor input scales
  that hexq does not write).
- routed experts: one scheme per layer (vLLM's fused MoE needs one), the artifact's expert grid at T = 4 or 8 bits.
  Every expert whose allocated b-bit code fits the T-bit scheme is written unchanged (b <= T; 1-bit symmetric as
  +-1 codes at half the scale). An artifact that skips experts (0 bits) is refused: hexq renormalises a skipped
  expert's routing weight onto the token's kept experts, which no compressed-tensors scheme expresses. An expert
  that does not fit (an 8-bit expert in a 4-bit layer, 1-bit asymmetric) is projected onto the layer's scheme with a
  GPTQ replica in that scheme: the artifact's export replicas (`hexq pack` keeps them for such experts, see
  hexq.pack.stage), else the widest stored bank replica that fits; round-to-nearest from the allocated weights only when
  no replica exists.
  `experts="auto"` gives a layer T = 4 unless that would need round-to-nearest, and T = 8 (every width exact) then.
- embeddings, norms, routers, biases: as stored in the artifact.

Peak memory: one expert's codes being re-packed, plus the open shards' headers; the check below streams three models
one layer at a time.

Modules: plan (each part's scheme and each expert's source), codec (compressed-tensors schemes and the exact code
mapping), write (streamed, sharded writing), check (the reload-and-compare check below), command (the command);
gguf (`--format gguf`: the same artifact as one GGUF file for llama.cpp, checked by llama.cpp itself).

The check (`check_export`) reloads the written folder through `ExportReader` (compressed-tensors' own
decompressors, per module; every file key must be read, none missing) and runs it streamed on held-out windows
beside (a) the artifact's model as `hexq run --policy static` serves it (hexq.runtime.model.artifact_model) and
(b) the source checkpoint in full precision when it is still there. It reports relative L2 of the logits, max
|delta logit|, argmax agreement and perplexity for each pair, and fails above `THRESHOLDS`:

- No projected expert: the export's weights are the served model's bit for bit, so what is left is activation
  quantization computed by compressed-tensors' code instead of hexq's: the same grid, but hexq rounds x/s + 128 (its
  codes are unsigned) where compressed-tensors rounds x/s, and about 7e-5 of the activations fall on the other side
  of a tie. Measured on 8 windows x 256 of held-out austen: relative L2 0 to 1e-4 (asymmetric activations, tiny
  models), 7.9e-4 (random Qwen2-MoE), 1.4e-3 and 3.4e-3 (symmetric activations, Qwen3-MoE and Mixtral reference
  models). Limit: relative L2 1e-2; a wrong scale on one layer's experts fails it (tests/test_export.py).
- Projected experts: the difference also holds what each replica used costs against the allocated one (an 8-bit
  expert at its 4-bit GPTQ replica). Limit: relative L2 0.05 and argmax agreement at least 90% (README gives the
  measured values).
"""
