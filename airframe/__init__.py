"""airframe: GGUF language models on the GPU through WebGPU, with a CUDA megakernel backend."""

__version__ = "0.1.0"
