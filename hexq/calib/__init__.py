"""Walking a model layer by layer: capture, baselines and (later) calibration passes."""
