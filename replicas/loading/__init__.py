"""Where a model comes from: its files, what the engine can serve, the embedded test models, GGUF
conversion, and loading it onto a device."""
