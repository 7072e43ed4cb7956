"""The megakernel on an NVIDIA GPU: the worker sources and their build, the probe, the runtime,
the backend (`--backend cuda`) and the benchmark."""
