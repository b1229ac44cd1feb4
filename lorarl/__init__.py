"""lorarl: parameter-efficient RL fine-tuning (GRPO, PPO, reward models) on one GPU.

One base model is loaded once (NF4 on CUDA); policy, reference, critic and reward model are LoRA adapters on it.
"""

__version__ = "0.1.0"
