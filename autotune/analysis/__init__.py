"""From measurements to decisions: recommend, deploy, knee, scaling, diagnose, sweeps."""
