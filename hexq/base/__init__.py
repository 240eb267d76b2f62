"""What every stage stands on: one-line errors, atomic writes and hashes, the output-folder rule, byte sizes, devices,
hidden states spilled to disk, and the bundled and shared text."""
