"""Below models/: attention backends, the KV pool, fused ops and triton kernels, the
per-GPU kernel tuning, the forward batch and the forward context layers read.

Nothing here imports models/ or engine/run/ (tests/engine/test_layering.py checks it)."""
