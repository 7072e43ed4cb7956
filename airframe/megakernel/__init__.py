"""The CUDA megakernel backend, in two rooms that follow the data flow.

plan/ (pure CPU, never imports cuda/): the plan format (opcodes), the planner that cuts a decode
token into tasks and waves, the package that carries the plan and BF16 weights, the validator, the
numpy VM that executes a plan exactly as the worker must, targets, and pictures of plans and traces.

cuda/: the worker sources (worker.cu and its headers; plan_format.h is generated from
plan/opcodes.py), their build, the probe, the runtime that launches a package, the backend and
the benchmark.

Design and plan format: docs/MEGAKERNEL.md.
"""
