"""The time budget (``--time-budget``): the plan of a run's length from measured step times
(plan). Imports the schedules (train/optim.py) and nothing else of the train layer."""
