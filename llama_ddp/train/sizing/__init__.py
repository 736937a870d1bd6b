"""--model-size auto: which member of the model family (model/family.py) to train in the time a
budget gives. law.py is the loss law, pure (the project's fit of its runs, the published law
beyond them, repeated data); rule.py the rule, pure (which sizes to time, which one wins);
auto.py times the candidates on the run's data, mode and ranks, and says what it chose;
stated.py makes the same choice for a device stated by its peak (the plan command's). Imports
the model family, the time budget (train/budget/) and what a run is built from (the config,
the parallelized model, the trainer's step), never run.py, which calls it."""
