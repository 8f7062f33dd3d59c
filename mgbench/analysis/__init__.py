"""Pure table-in/table-out analysis: figures, divergence, calibration, the CI gate. Nothing
here imports torch, a model or an engine (tests/test_layout.py checks it)."""
