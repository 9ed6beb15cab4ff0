"""Layer 3, the scope: a block's parameters in one host and one device buffer, its states and its parts
(streams, loads, host masters, device buffer, written masters, old gradients), experts, and which
calls can still add to its gradients. Imports dispatch/ and below."""
