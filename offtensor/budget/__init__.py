"""Layer 4, the VRAM budget: which scopes stay on the device, laid out by measured time. Imports scopes/
and below."""
