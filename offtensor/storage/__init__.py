"""Layer 1, the bytes of masters: page-locked host memory, compressed formats and their Triton kernels,
masters kept in files, the staging ring, memory shared by the processes of a node, and safetensors
checkpoints read tensor by tensor. Imports only api.py and patches.py."""
