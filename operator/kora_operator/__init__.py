"""kora operator: reconciles LoRATrainingJob / LoRAAdapter objects into KubeRay RayJobs."""
