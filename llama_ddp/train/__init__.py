"""The composition root: the config composed of every component's settings (config) and the
train command (cli; ``python -m llama_ddp.train`` runs it), the run that builds everything (run),
the loop (trainer), optimizers and schedules (optim, muon), what a run reports (metrics), how fast
it goes (speed), the time budget's plan (budget), validation during training (validation),
preemption and the fault-injection hook (preemption). May import every other layer; only the
commands import it (plot reads metrics).
"""
