"""Stored weights on the device, for the kernel tests: the one helper they share."""

from __future__ import annotations

from numba import cuda

from pycalm.model import formats


def to_device(w: object) -> object:
    """A stored array, or both arrays of a q8 / q4 formats.Quantized, on the device."""
    if isinstance(w, formats.Quantized):
        return formats.Quantized(cuda.to_device(w.codes), cuda.to_device(w.scales))
    return cuda.to_device(w)
