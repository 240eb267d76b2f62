"""hexq pack: a calibration's importance, placement and allocation into one packed, checksummed artifact (stage.py),
each layer's tensors cut from the calibration's banks (tensors.py)."""
