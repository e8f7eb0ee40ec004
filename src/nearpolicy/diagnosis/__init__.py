"""`nearpolicy diagnose`: measure the engine/trainer mismatch of rollout configurations before a run, scan
per-layer sensitivity to quantization, and admit or reject candidates against a calibrated budget."""
