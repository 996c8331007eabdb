"""Many configs, one study: the search space, the Optuna study and its storage, seats
and workers, and the study's twin."""
