"""The composition root: the config composed of every component's settings (config) and its
command line (cli), the run that builds everything (run), the loop (trainer), optimizers and
schedules (optim, muon), what a run reports and its curves (metrics), how fast it goes (speed),
validation during training (validation), preemption and the fault-injection hook (preemption).
May import every other layer; nothing imports it.
"""
