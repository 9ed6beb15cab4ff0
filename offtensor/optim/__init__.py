"""Layer 6, optimizer steps overlapped with backward, on the host and on the device. Imports engine/ and below."""
