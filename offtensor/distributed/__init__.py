"""Data parallel: one host copy per node, sharded loads, and the wrappers of DDP and FSDP."""
