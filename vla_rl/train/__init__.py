"""Trainers: SFT now; advantage-weighted, QAM and pi-RL noise + PPO as their issue lands."""
