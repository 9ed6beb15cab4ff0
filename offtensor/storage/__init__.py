"""Layer 1, the bytes of masters: page-locked host memory, compressed masters (`compress.py`) and the
built-in frozen formats (`row_scaled.py`, `fp8.py`, `int8.py`) with their Triton kernels, masters kept
in files, the staging ring, memory shared by the processes of a node, and safetensors checkpoints read
tensor by tensor. Imports only api.py, formats.py and patches.py."""
