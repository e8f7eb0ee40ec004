"""Gradient bias of mismatch corrections: each correction's policy gradient on engine samples against the
on-policy gradient at the same weights (docs/gradbias.md). estimate.py: the statistics (pure numpy); sketch.py:
the seeded count-sketch a gradient is stored as; measure.py: sampling and per-correction gradients; run.py: the
`nearpolicy gradbias` command; page.py: its table and plot."""
