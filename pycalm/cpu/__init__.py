"""The CPU engine: the whole forward pass in NumPy, in order (reference.py: the specification
every GPU kernel is tested against), the engine built from it, and the sampler."""
