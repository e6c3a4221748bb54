"""Training: the pure update and SFT steps on a device mesh, the shared RL loop, and the
comparison (paired statistics over seeds, plots) every per-paper script runs."""
