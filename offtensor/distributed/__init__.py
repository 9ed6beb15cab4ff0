"""Layer 8, data parallel: one host copy per node, sharded loads, gradient averaging and the ranks'
agreement. Imports model/ and below."""
