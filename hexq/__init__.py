"""hexq: quantization, calibration and budgeted serving for Mixture-of-Experts language models."""

__version__ = "0.1.0"
