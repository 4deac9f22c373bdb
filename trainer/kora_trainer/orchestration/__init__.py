"""Running a job: the prompt data, the rollout manager, engine processes, and the Ray actors around them."""
