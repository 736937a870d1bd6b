"""The time budget (``--time-budget``): its seconds (duration), the rule that turns the steps the
time left holds into a schedule (plan), and its owner, which measures and decides when to plan
(budget). Imports the schedules (train/optim.py) and the checkpoint's bounds
(checkpoint/schema.py), nothing else of the train layer."""
