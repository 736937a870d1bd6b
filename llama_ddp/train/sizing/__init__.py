"""--model-size auto: which member of the model family (model/family.py) to train in the time a
budget gives. rule.py is the rule, pure (the loss fit, which sizes to time, which one wins);
auto.py times the candidates on the run's data, mode and ranks, and says what it chose. Imports
the model family, the time budget (train/budget/) and what a run is built from (the config,
the parallelized model, the trainer's step), never run.py, which calls it."""
