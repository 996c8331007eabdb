"""The vocabulary every part shares: request records, SLOs, metrics, errors, flags, files (pure)."""
