"""The packed-weight codec every stage speaks: dense 1-8 bit packing (bitpack), a quantized matrix as stored
(weight: PackedWeight, its dequantization and byte size), the export grids a stored code fits (grids) and the
compiled CPU dequantization kernel (kernel). Imports nothing of hexq but the base modules."""
