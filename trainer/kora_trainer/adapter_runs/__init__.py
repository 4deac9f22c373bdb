"""Multi-adapter jobs' registry and its `/adapter_runs` routes on the control plane (config/adapter_runs.py
holds the wire models)."""
