"""Processes, devices and wrappers: the runtime (runtime: torchrun's ranks, the process groups,
barriers) and the one place the model to train is made for each mode (parallelize: DDP, FSDP,
compile, activation checkpointing). Imports model/, files/ and the package's top.
"""
