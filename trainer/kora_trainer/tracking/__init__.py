"""Experiment tracking: the step recorder's metrics, under verl-style names, into TensorBoard and W&B.

`names.py` turns one step's numbers into `{tag: value}` (the one mapping; docs/metrics.md tables it); `sinks.py`
writes such dicts to each tracker the job's `tracking:` section turns on. The recorder (recorder.py) is the only
caller: there is no second path the metrics take.
"""

from kora_trainer.tracking.names import adapter_scalars, checkpoint_scalars, step_scalars
from kora_trainer.tracking.sinks import Sink, TrackingError, open_sinks

__all__ = ["Sink", "TrackingError", "adapter_scalars", "checkpoint_scalars", "open_sinks", "step_scalars"]
