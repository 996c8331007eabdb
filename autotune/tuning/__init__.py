"""Judging one config: the steady-state verdict and its sequential test, the ceiling
search, the trial and its stored record, the overload pruner, validation, the floor,
the simulator twin and calibration."""
