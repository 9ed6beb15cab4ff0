"""The VRAM budget: which scopes stay on the device, laid out by measured time."""
