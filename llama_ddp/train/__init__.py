"""The composition root: the config and its command line (config, cli), the run that builds
everything (run), the loop (trainer), optimizers and schedules (optim), metrics and their sinks
(metrics, plot), validation during training (validation), preemption and fault injection
(preemption, faults). May import every other layer; nothing imports it.
"""
