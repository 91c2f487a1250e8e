"""bin/bench: offline throughput, online serving load, and decode latency vs the HBM roofline.

Each mode prints its settings, shows progress, prints a results table and writes one JSON
record (see `engine.bench.report.make_record`). Entry point: `python -m engine.bench`.
"""
