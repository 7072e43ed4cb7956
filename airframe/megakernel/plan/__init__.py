"""The megakernel's planning side, pure CPU: opcodes and the plan format, targets, the planner,
packages, the validator, the numpy VM and pictures. Nothing here imports ..cuda."""
