"""Reinforcement learning proper: tasks with verifiable rewards, GRPO advantages, the PPO loss."""
