"""Pure functions: a LoRATrainingJob in, the Kubernetes objects the operator creates out."""
