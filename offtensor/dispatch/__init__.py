"""Layer 2, the parameter: its slot (`ParamSlot`) and its scope's call counters (`CallCounts`),
the subclass (`OffloadedParameter`) and how an op on it gets its device copy, writes to masters,
gradients, torch.compile, and the guards against DDP and FSDP. Imports storage/ and below."""
