"""The packed-weight codec every stage speaks: dense 1-8 bit packing (bitpack), a quantized matrix as stored
(weight: PackedWeight, its dequantization and byte size), the export grids a stored code fits (grids), and the
kernels that compute from packed codes: on the CPU (cpu: kernels.c, a grouped GEMV and the dequantization) and on
the GPU (triton: the pair GEMV). Imports nothing of hexq but the base modules."""
