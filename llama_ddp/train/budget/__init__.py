"""The time budget (``--time-budget``): its seconds (duration), the rule that turns the steps the
time left holds into a schedule (plan), its owner, which measures and decides when to plan
(budget), and --model-size auto's rule, which size of the model family the time favours (size).
Imports the schedules (train/optim.py), the checkpoint's bounds (checkpoint/schema.py) and the
model family (model/family.py), nothing else of the train layer."""
