"""Weight sync: bucketed pushes of the policy from the trainer (rank 0) to the rollout engines."""
