"""The CUDA megakernel backend: a planner that cuts a decode token into tasks, the package that
carries the plan and BF16 weights, a validator, and a numpy VM that executes a plan exactly as the
CUDA worker must. Design and plan format: docs/MEGAKERNEL.md.
"""
