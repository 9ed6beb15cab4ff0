"""Optimizer steps overlapped with backward, on the host and on the device."""
