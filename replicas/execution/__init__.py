"""A pass on the device: the model runner, attention backends, compiled and captured decode steps,
the sampler and its logits processors, guided decoding masks, and the tensor-parallel executor."""
