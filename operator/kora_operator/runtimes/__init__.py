"""Where the trainer runs: KubeRay (a RayJob per LoRATrainingJob; handlers/reconcile.py and
phase.py) or Ray (a submission to an existing Ray cluster through its Jobs API; ray.py here)."""
