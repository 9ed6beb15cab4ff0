"""What a master holds and where it comes from: compressed and quantized formats, checkpoint
loading, file-backed masters."""
