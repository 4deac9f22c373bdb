"""The RL math: GRPO advantages and the clipped policy loss (`grpo`), and the reward functions (`rewards`)."""
