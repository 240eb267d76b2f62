"""The packed-weight codec: bit packing, packed matrices and their (de)quantization, and the kernels that compute
from packed codes."""
