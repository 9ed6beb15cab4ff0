"""The parameter subclass: how an op on an offloaded parameter gets its device copy, and torch.compile."""
